// The paced loop of compute_bench (20 us host work + one empty launch) in 4
// consecutive windows of COUNT iterations in one process: one-time costs land
// in the first window, and a process that speeds up as it runs shows it.
// Run by scripts/bench/launch_cost.sh.
#include <chrono>
#include <cstdio>
#include <cstdlib>
__global__ void empty_kernel() {}
static double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static void host_work(double us) { double until = now_s() + us * 1e-6; while (now_s() < until) {} }
int main(int argc, char **argv) {
    long count = argc > 1 ? atol(argv[1]) : 6000;
    empty_kernel<<<1, 1>>>();
    cudaDeviceSynchronize();
    printf("mode=windows");
    for (int w = 0; w < 4; w++) {
        double start = now_s(), in_call = 0;
        for (long i = 0; i < count; i++) {
            host_work(20);
            double before = now_s();
            empty_kernel<<<1, 1>>>();
            in_call += now_s() - before;
        }
        double wall = now_s() - start;
        printf(" iter%d=%.1f call%d=%.1f", w, wall * 1e9 / count, w, in_call * 1e9 / count);
    }
    cudaDeviceSynchronize();
    printf("\n");
    return 0;
}
