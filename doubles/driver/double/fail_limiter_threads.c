/*
 * A test fixture, preloaded after the limiter: pthread_create fails with
 * EAGAIN when the limiter's library asks for a thread, as it does in a pod
 * at its limit of processes and threads (pids.max); every other caller gets
 * its thread. Tests the limiter without its monitor thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>

typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

__attribute__((visibility("default"))) int pthread_create(pthread_t *thread,
                                                          const pthread_attr_t *attr,
                                                          void *(*start)(void *), void *arg) {
    static create_fn real;
    Dl_info caller;
    if (dladdr(__builtin_return_address(0), &caller) && caller.dli_fname &&
        strstr(caller.dli_fname, "libcuda_limiter")) {
        return EAGAIN;
    }
    if (!real) {
        real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
    }
    return real ? real(thread, attr, start, arg) : EAGAIN;
}
