// "A model finishing layers", for the watcher tests: one GPU thread busy-waits for a
// given number of SM clock cycles per layer, then signals the layer by adding 1 to a
// watched word in mapped pinned host memory (afabric's uvm_watcher(device=...)), the way
// a real model's last kernel of a layer would. Compiled at run time by CuPy (NVRTC).
extern "C" __global__ void layers(unsigned long long *word, int n_layers, long long spin_cycles,
                                  unsigned long long *stamps_ns)
{
    if (blockIdx.x != 0 || threadIdx.x != 0)
        return;
    for (int l = 0; l < n_layers; l++) {
        long long t0 = clock64();
        while (clock64() - t0 < spin_cycles) {
        }
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        stamps_ns[l] = now;       // when the layer ended, in the GPU's nanosecond clock
        __threadfence_system();   // the layer's output is visible before its signal
        atomicAdd(word, 1ULL);
        __threadfence_system();   // and the signal leaves for host memory now
    }
}
