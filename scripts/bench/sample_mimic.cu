// Run by scripts/bench/launch_cost.sh --mimic.
// What a limiter sample costs a paced loop, mimicked in one unlimited process:
// windows of COUNT iterations (20 us host work + one empty launch), modes
// alternated window by window: 0 nothing; 1 every 640th launch bracketed like
// a sample (stream query, event records) and read by a monitor thread (woken
// by a condition variable, polling every 100 us); 2 the same read by the
// launching thread at the next sample; 3 as 1 without the stream query;
// 4 as 1 with the events' timing disabled.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <atomic>
__global__ void empty_kernel() {}
static double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static void host_work(double us) { double until = now_s() + us * 1e-6; while (now_s() < until) {} }
std::mutex mu; std::condition_variable cv; cudaEvent_t pend_a = nullptr, pend_b = nullptr; bool has = false, quit = false;
std::atomic<long> reads{0};
static void monitor() {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
        cv.wait(lock, [] { return has || quit; });
        if (quit) return;
        cudaEvent_t a = pend_a, b = pend_b; has = false;
        lock.unlock();
        while (cudaEventQuery(b) == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::microseconds(100));
        float ms; cudaEventElapsedTime(&ms, a, b); reads++;
        lock.lock();
    }
}
int main(int argc, char **argv) {
    long count = argc > 1 ? atol(argv[1]) : 6000;
    int rounds = argc > 2 ? atoi(argv[2]) : 2;
    empty_kernel<<<1, 1>>>(); cudaDeviceSynchronize();
    cudaEvent_t ev[8], evn[8];
    for (int i = 0; i < 8; i++) { cudaEventCreate(&ev[i]); cudaEventCreateWithFlags(&evn[i], cudaEventDisableTiming); }
    std::thread mon(monitor);
    int e = 0;
    cudaEvent_t own_a = nullptr, own_b = nullptr;
    printf("mode=samplecost");
    for (int r = 0; r < rounds; r++) {
        for (int mode = 0; mode < 5; mode++) {
            double start = now_s(), in_call = 0;
            for (long i = 0; i < count; i++) {
                host_work(20);
                bool sample = mode != 0 && i % 640 == 320;
                double before = now_s();
                if (sample) {
                    cudaEvent_t *pool = mode == 4 ? evn : ev;
                    cudaEvent_t a = pool[e % 8], b = pool[(e + 1) % 8]; e += 2;
                    if (mode != 3) cudaStreamQuery(0);
                    if (mode == 2 && own_b) { while (cudaEventQuery(own_b) == cudaErrorNotReady) {} float ms; cudaEventElapsedTime(&ms, own_a, own_b); }
                    cudaEventRecord(a, 0);
                    empty_kernel<<<1, 1>>>();
                    cudaEventRecord(b, 0);
                    if (mode == 2) { own_a = a; own_b = b; }
                    else { std::lock_guard<std::mutex> g(mu); pend_a = a; pend_b = b; has = true; cv.notify_one(); }
                } else {
                    empty_kernel<<<1, 1>>>();
                }
                in_call += now_s() - before;
            }
            double wall = now_s() - start;
            printf(" r%dm%d=%.1f/%.1f", r, mode, wall * 1e9 / count, in_call * 1e9 / count);
            cudaDeviceSynchronize();
        }
    }
    { std::lock_guard<std::mutex> g(mu); quit = true; cv.notify_one(); }
    mon.join();
    printf(" reads=%ld\n", reads.load());
    return 0;
}
