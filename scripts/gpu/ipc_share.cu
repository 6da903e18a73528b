// Checks 40 and 41: memory that one process of a pod exports and another of
// the same pod imports is charged once, to the exporter. NVML (nvidia-smi)
// attributes imported memory to the exporter alone (measured), so the
// importer's footprint holds only its own memory.
//
// The exporter allocates 2 GiB, fills it with a pattern, exports it and
// starts the importer: itself again (fork, then at once exec of
// /proc/self/exe: a forked child cannot use CUDA), with the handle on its
// command line; the importer inherits the environment, so both are
// processes of the same pod. The importer imports the memory, reads a few
// bytes back at each end to check the pattern, then cudaMallocs 256 MiB of
// its own and then 1 GiB more. Both hold what they have until
// <release-file> exists (polls every 100 ms, gives up after <max_s> seconds,
// default 120); then the importer releases and exits, and the exporter,
// once the importer has exited, releases and exits.
//   legacy  cudaMalloc, cudaIpcGetMemHandle; the importer gets the handle's
//           bytes in hex and cudaIpcOpenMemHandle's them
//   vmm     cuMemCreate with a POSIX file descriptor handle requested,
//           cuMemAddressReserve, cuMemMap, cuMemSetAccess;
//           cuMemExportToShareableHandle to an fd kept open across exec (no
//           FD_CLOEXEC); the importer gets the fd's number,
//           cuMemImportFromShareableHandle's it and maps it likewise
// Prints key=value lines. The exporter: pid=, mode=, ctx_rc=, then
// <step>_rc= for its steps (alloc, [reserve, map, access,] memset, export,
// [cloexec]), spawn_rc= (0 or the errno of fork), importer_pid=,
// importer_exit= (the importer's exit status, 128+N for signal N), done=1.
// The importer (its keys are its own): import_pid=, import_ctx_rc=, its
// import steps' import_<step>_rc=, import_rc= (the first failure of the
// import steps, 0 when none), import_read_rc=, import_ok=1 when the pattern
// read back is the exporter's, own_rc= (256 MiB), more_rc= (1 GiB more),
// holding=1 once it holds, importer_done=1.
// Exit status 0 whatever the driver answered; 64 on a usage error.
// Usage: ipc_share <legacy|vmm> [release-file [max_s]]             (exporter)
//        ipc_share import <legacy|vmm> <handle> <release-file> <max_s>
//                                                  (importer, started by the exporter)
// Build: nvcc -O2 -arch=sm_90 -o ipc_share ipc_share.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static const size_t MiB = 1ull << 20;
static const size_t SHARED = 2048 * MiB;  // exported (a multiple of the VMM granularity, 2 MiB)
static const size_t OWN = 256 * MiB;      // the importer's own
static const size_t MORE = 1024 * MiB;    // and then more
static const unsigned char PATTERN = 0x5a;
static const size_t CHECKED = 64;  // bytes read back at each end of the shared memory

static int rt(const char *key, cudaError_t e) {
  printf("%s_rc=%d\n", key, (int)e);
  cudaGetLastError();  // a failed call is not sticky: later calls must not see it
  return (int)e;
}

static int drv(const char *key, CUresult r) {
  printf("%s_rc=%d\n", key, (int)r);
  return (int)r;
}

// Until <release> exists or max_s seconds; when child > 0, also until it exits
// (then *status is its wait status and true is returned). Without a release
// file and a child, at once.
static bool hold(const char *release, int max_s, pid_t child, int *status) {
  if (!release && child <= 0) return false;
  for (long i = 0; i < (long)max_s * 10; i++) {
    if (release && access(release, F_OK) == 0) return false;
    if (child > 0 && waitpid(child, status, WNOHANG) == child) return true;
    usleep(100 * 1000);
  }
  return false;
}

static CUmemAllocationProp vmm_prop() {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Maps <handle> at a new range of SHARED bytes, read-write for device 0.
// Prints <prefix>reserve_rc, map_rc, access_rc; returns the first failure.
static CUresult vmm_map(const char *prefix, CUmemGenericAllocationHandle handle, CUdeviceptr *va, bool *mapped) {
  char key[64];
  snprintf(key, sizeof key, "%sreserve", prefix);
  CUresult r = cuMemAddressReserve(va, SHARED, 0, 0, 0);
  if (drv(key, r) != CUDA_SUCCESS) {
    *va = 0;
    return r;
  }
  snprintf(key, sizeof key, "%smap", prefix);
  r = cuMemMap(*va, SHARED, 0, handle, 0);
  if (drv(key, r) != CUDA_SUCCESS) return r;
  *mapped = true;
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  snprintf(key, sizeof key, "%saccess", prefix);
  return (CUresult)drv(key, cuMemSetAccess(*va, SHARED, &access, 1));
}

static void vmm_unmap(CUdeviceptr va, bool mapped) {
  if (mapped) cuMemUnmap(va, SHARED);
  if (va) cuMemAddressFree(va, SHARED);
}

// ---------------------------------------------------------------- exporter

struct Exported {
  void *ptr = nullptr;  // legacy
  CUmemGenericAllocationHandle handle = 0;  // vmm
  bool created = false, mapped = false;
  CUdeviceptr va = 0;
  int fd = -1;
};

// Allocates, fills and exports SHARED bytes; the handle as text in <text>.
static bool export_legacy(Exported &x, char *text, size_t cap) {
  if (rt("alloc", cudaMalloc(&x.ptr, SHARED)) != 0) {
    x.ptr = nullptr;
    return false;
  }
  cudaError_t e = cudaMemset(x.ptr, PATTERN, SHARED);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (rt("memset", e) != 0) return false;
  cudaIpcMemHandle_t h;
  memset(&h, 0, sizeof h);
  if (rt("export", cudaIpcGetMemHandle(&h, x.ptr)) != 0) return false;
  const unsigned char *b = reinterpret_cast<const unsigned char *>(&h);
  if (cap < 2 * sizeof h + 1) return false;
  for (size_t i = 0; i < sizeof h; i++) snprintf(text + 2 * i, 3, "%02x", b[i]);
  return true;
}

static bool export_vmm(Exported &x, char *text, size_t cap) {
  CUmemAllocationProp prop = vmm_prop();
  if (drv("alloc", cuMemCreate(&x.handle, SHARED, &prop, 0)) != CUDA_SUCCESS) return false;
  x.created = true;
  if (vmm_map("", x.handle, &x.va, &x.mapped) != CUDA_SUCCESS) return false;
  CUresult r = cuMemsetD8(x.va, PATTERN, SHARED);
  if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
  if (drv("memset", r) != CUDA_SUCCESS) return false;
  int fd = -1;
  r = cuMemExportToShareableHandle(&fd, x.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (drv("export", r) != CUDA_SUCCESS) return false;
  x.fd = fd;
  // The importer gets the fd by its number: it must stay open across exec.
  int flags = fcntl(fd, F_GETFD);
  int cloexec = flags < 0 || fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC) < 0 ? errno : 0;
  printf("fd=%d\ncloexec_rc=%d\n", fd, cloexec);
  if (cloexec) return false;
  snprintf(text, cap, "%d", fd);
  return true;
}

static void release_exported(Exported &x) {
  if (x.ptr) cudaFree(x.ptr);
  vmm_unmap(x.va, x.mapped);
  if (x.created) cuMemRelease(x.handle);
  if (x.fd >= 0) close(x.fd);
}

static int exporter(const char *self, const char *mode, const char *release, int max_s) {
  printf("pid=%d\nmode=%s\n", (int)getpid(), mode);
  cudaError_t e = cudaFree(0);
  printf("ctx_rc=%d\n", (int)e);
  Exported x;
  char handle[2 * sizeof(cudaIpcMemHandle_t) + 1] = "";
  bool vmm = !strcmp(mode, "vmm");
  bool ok = e == cudaSuccess && (vmm ? export_vmm(x, handle, sizeof handle) : export_legacy(x, handle, sizeof handle));
  pid_t child = -1;
  if (ok) {
    char max[16];
    snprintf(max, sizeof max, "%d", max_s);
    // Everything the child needs is made before fork: it only execs.
    char *args[] = {const_cast<char *>(self), const_cast<char *>("import"), const_cast<char *>(mode), handle,
                    const_cast<char *>(release ? release : "-"), max, nullptr};
    fflush(stdout);
    fflush(stderr);
    child = fork();
    if (child == 0) {
      execv("/proc/self/exe", args);
      _exit(127);
    }
    printf("spawn_rc=%d\n", child < 0 ? errno : 0);
  }
  if (child > 0) {
    printf("importer_pid=%d\n", (int)child);
    fflush(stdout);
    int status = 0;
    // The importer holds until the release file exists; the exporter holds
    // its memory at least as long, and stops early when the importer exits.
    if (!hold(release, max_s, child, &status)) {
      while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
      }
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
    printf("importer_exit=%d\n", code);
  }
  release_exported(x);
  printf("done=1\n");
  return 0;
}

// ---------------------------------------------------------------- importer

struct Imported {
  void *ptr = nullptr;  // legacy: the opened handle
  CUmemGenericAllocationHandle handle = 0;  // vmm
  bool imported = false, mapped = false;
  CUdeviceptr va = 0;
  int fd = -1;
  void *own = nullptr, *more = nullptr;
};

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The import's first failure (legacy: cudaError_t, vmm: CUresult); *base is
// where the shared memory is mapped in this process.
static int import_legacy(Imported &m, const char *text, void **base) {
  cudaIpcMemHandle_t h;
  memset(&h, 0, sizeof h);
  unsigned char *b = reinterpret_cast<unsigned char *>(&h);
  bool parsed = strlen(text) == 2 * sizeof h;
  for (size_t i = 0; parsed && i < sizeof h; i++) {
    int hi = hexval(text[2 * i]), lo = hexval(text[2 * i + 1]);
    parsed = hi >= 0 && lo >= 0;
    b[i] = (unsigned char)(hi << 4 | lo);
  }
  printf("import_parsed=%d\n", parsed);
  if (!parsed) return (int)cudaErrorInvalidValue;
  int rc = rt("import_open", cudaIpcOpenMemHandle(&m.ptr, h, cudaIpcMemLazyEnablePeerAccess));
  if (rc != 0) m.ptr = nullptr;
  *base = m.ptr;
  return rc;
}

static int import_vmm(Imported &m, const char *text, void **base) {
  char *end = nullptr;
  long fd = strtol(text, &end, 10);
  if (!*text || *end || fd < 0) return (int)CUDA_ERROR_INVALID_VALUE;
  m.fd = (int)fd;
  // A POSIX fd handle is passed as the fd's value, cast to a pointer.
  CUresult r = cuMemImportFromShareableHandle(&m.handle, (void *)(uintptr_t)m.fd,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (drv("import_open", r) != CUDA_SUCCESS) return (int)r;
  m.imported = true;
  r = vmm_map("import_", m.handle, &m.va, &m.mapped);
  *base = r == CUDA_SUCCESS ? (void *)m.va : nullptr;
  return (int)r;
}

static int importer(const char *mode, const char *text, const char *release, int max_s) {
  printf("import_pid=%d\n", (int)getpid());
  cudaError_t e = cudaFree(0);
  printf("import_ctx_rc=%d\n", (int)e);
  cudaGetLastError();
  Imported m;
  void *base = nullptr;
  int rc = (int)e;
  if (e == cudaSuccess) rc = !strcmp(mode, "vmm") ? import_vmm(m, text, &base) : import_legacy(m, text, &base);
  printf("import_rc=%d\n", rc);
  int ok = 0;
  if (rc == 0 && base) {
    unsigned char got[2 * CHECKED];
    memset(got, 0, sizeof got);
    const char *p = static_cast<const char *>(base);
    e = cudaMemcpy(got, p, CHECKED, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(got + CHECKED, p + SHARED - CHECKED, CHECKED, cudaMemcpyDeviceToHost);
    rt("import_read", e);
    ok = e == cudaSuccess;
    for (size_t i = 0; ok && i < sizeof got; i++) ok = got[i] == PATTERN;
  }
  printf("import_ok=%d\n", ok);
  // The pod's quota, less what is charged already, is what these may take.
  if (rt("own", cudaMalloc(&m.own, OWN)) != 0) m.own = nullptr;
  if (m.own && rt("own_memset", cudaMemset(m.own, 0, OWN)) == 0) rt("own_sync", cudaDeviceSynchronize());
  if (rt("more", cudaMalloc(&m.more, MORE)) != 0) m.more = nullptr;
  if (m.more && rt("more_memset", cudaMemset(m.more, 0, MORE)) == 0) rt("more_sync", cudaDeviceSynchronize());
  bool held = strcmp(release, "-") != 0;
  if (held) printf("holding=1\n");
  fflush(stdout);
  int status = 0;
  hold(held ? release : nullptr, max_s, -1, &status);
  if (m.more) cudaFree(m.more);
  if (m.own) cudaFree(m.own);
  if (m.ptr) cudaIpcCloseMemHandle(m.ptr);
  vmm_unmap(m.va, m.mapped);
  if (m.imported) cuMemRelease(m.handle);
  if (m.fd >= 0) close(m.fd);
  printf("importer_done=1\n");
  return 0;
}

static bool known_mode(const char *mode) { return !strcmp(mode, "legacy") || !strcmp(mode, "vmm"); }

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc >= 6 && !strcmp(argv[1], "import") && known_mode(argv[2]))
    return importer(argv[2], argv[3], argv[4], atoi(argv[5]));
  if (argc >= 2 && known_mode(argv[1]))
    return exporter(argv[0], argv[1], argc > 2 ? argv[2] : nullptr, argc > 3 ? atoi(argv[3]) : 120);
  fprintf(stderr,
          "usage: %s <legacy|vmm> [release-file [max_s]]\n"
          "       %s import <legacy|vmm> <handle> <release-file> <max_s>  (started by the exporter)\n",
          argv[0], argv[0]);
  return 64;
}
