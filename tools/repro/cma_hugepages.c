/* One process_vm_writev of 1 MiB at a time into a child's buffer of REGION bytes (offset 0),
 * 20,000 times: the single-copy floor that cma's 1 MiB rows are read against. Both buffers
 * start on a 2 MiB boundary; HUGE_SRC=1 / HUGE_DST=1 advise the source / the target for
 * transparent huge pages (madvise(MADV_HUGEPAGE)) before they are first touched.
 * cc -O2 -Wall -Wextra -Werror -o /tmp/cma_hugepages tools/repro/cma_hugepages.c
 * /tmp/cma_hugepages 4194304; HUGE_DST=1 /tmp/cma_hugepages 4194304 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HUGE (2u << 20)

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    size_t region = argc > 1 ? strtoull(argv[1], NULL, 0) : 1u << 20, len = 1u << 20;
    const int iters = 20000;
    int pfd[2];
    if (region < len || pipe(pfd) != 0)
        return 1;
    pid_t child = fork();
    if (child < 0)
        return 1;
    if (child == 0) {
        void *v = NULL;
        if (posix_memalign(&v, HUGE, region) != 0)
            return 1;
        unsigned char *b = v;
        if (getenv("HUGE_DST") && madvise(b, region, MADV_HUGEPAGE) != 0)
            perror("madvise");
        memset(b, 0, region);
        void *p = b;
        if (write(pfd[1], &p, sizeof p) != (ssize_t)sizeof p)
            return 1;
        pause();
        return 0;
    }
    void *rb, *v = NULL;
    if (posix_memalign(&v, HUGE, HUGE) != 0)
        return 1;
    unsigned char *src = v;
    if (getenv("HUGE_SRC") && madvise(src, HUGE, MADV_HUGEPAGE) != 0)
        perror("madvise");
    if (read(pfd[0], &rb, sizeof rb) != (ssize_t)sizeof rb)
        return 1;
    memset(src, 1, len);
    struct iovec l = {src, len}, r = {rb, len};
    int rc = 0;
    for (int i = 0; i < 100 + iters && !rc; i++) {
        static double t0;
        if (i == 100)
            t0 = now();
        if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)len) {
            perror("process_vm_writev");
            rc = 1;
        }
        if (i == 100 + iters - 1)
            printf("region %zu: %.2f GB/s\n", region, (double)len * iters / (now() - t0) / 1e9);
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return rc;
}
