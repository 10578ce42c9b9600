/* One process_vm_writev of 1 MiB at a time into a child's buffer of REGION bytes (offset 0),
 * 20,000 times: the single-copy floor that cma's 1 MiB rows are read against.
 * cc -O2 -Wall -Wextra -Werror -o /tmp/pvm docs/bench/issue15/nixl/pvm.c && /tmp/pvm 1048576 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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
        unsigned char *b = malloc(region);
        if (!b)
            return 1;
        memset(b, 0, region);
        void *p = b;
        if (write(pfd[1], &p, sizeof p) != (ssize_t)sizeof p)
            return 1;
        pause();
        return 0;
    }
    void *rb;
    unsigned char *src = malloc(len);
    if (read(pfd[0], &rb, sizeof rb) != (ssize_t)sizeof rb || !src)
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
