/* How fast can one writer copy into another process (the cma provider's data path)?
 * process_vm_writev from this process into a forked child's 64 MiB buffer, each write split
 * over T threads (1, 2, 4, 8), rotating through the region as `afabric bench p2p` does so
 * no size is measured cache-resident; one thread's memcpy beside it.
 * Build and run: cc -O2 -std=gnu11 -pthread -Wall -o /tmp/cma_parallel_copy
 * tools/repro/cma_parallel_copy.c && /tmp/cma_parallel_copy */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { pid_t pid; char *src; uintptr_t dst; size_t len; int iters; size_t stride, region; } job;
static void *run(void *a){ job *j=a; for(int i=0;i<j->iters;i++){ size_t rot=((size_t)i*j->stride)%j->region; char *src=j->src+rot; uintptr_t dst=j->dst+rot; struct iovec l, r;
  size_t done=0; while(done<j->len){ l.iov_base=src+done; l.iov_len=j->len-done; r.iov_base=(void*)(dst+done); r.iov_len=j->len-done;
  ssize_t n=process_vm_writev(j->pid,&l,1,&r,1,0); if(n<=0){perror("pvw");exit(1);} done+=n; } } return NULL; }
int main(void){
  size_t region=64u<<20; int pfd[2]; if(pipe(pfd))return 1;
  char *dstbuf;
  pid_t pid=fork(); if(pid==0){ char *b=malloc(region); memset(b,1,region); if(write(pfd[1],&b,sizeof(b))!=sizeof(b))_exit(1); for(;;) pause(); }
  if(read(pfd[0],&dstbuf,sizeof(dstbuf))!=sizeof(dstbuf))return 1;
  char *local=malloc(region); memset(local,1,region);
  char *src=malloc(region); memset(src,2,region);
  size_t sizes[]={64u<<10,1u<<20,16u<<20}; int threads[]={1,2,4,8};
  for(int s=0;s<3;s++){ size_t sz=sizes[s]; int iters=(int)((4ull<<30)/sz); if(iters>20000)iters=20000;
    /* memcpy, one thread, rotating through the region */
    double t0=now(); for(int i=0;i<iters;i++){ size_t off=(i*sz)%region; memcpy(local+off,src+off,sz);} double tm=now()-t0;
    printf("size %8zu memcpy 1T %6.2f GB/s |", sz, iters*(double)sz/tm/1e9);
    for(int ti=0;ti<4;ti++){ int T=threads[ti]; pthread_t th[8]; job j[8]; size_t part=sz/T;
      for(int k=0;k<T;k++){ j[k]=(job){pid,src+k*part,(uintptr_t)dstbuf+k*part,part,iters,sz,region-sz}; }
      t0=now(); for(int k=0;k<T;k++) pthread_create(&th[k],NULL,run,&j[k]); for(int k=0;k<T;k++) pthread_join(th[k],NULL);
      double tt=now()-t0; printf(" pvw %dT %6.2f", T, iters*(double)sz/tt/1e9); }
    printf(" GB/s\n"); }
  kill(pid,SIGKILL); waitpid(pid,NULL,0); return 0; }
