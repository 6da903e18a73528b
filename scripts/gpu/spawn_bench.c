/* Check 10: start-up cost of a non-CUDA program.
 * Usage: spawn_bench <n> <program> [KEY=VALUE ...]
 * posix_spawns <program> n times (each waited for) with this process's
 * environment plus the KEY=VALUE entries (which replace same-named ones),
 * so the benchmark process itself is never preloaded.
 * Prints mean_us=<float> failures=<count>.
 * Build: gcc -O2 -o spawn_bench spawn_bench.c */
#define _GNU_SOURCE
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

extern char **environ;

static int overridden(const char *entry, int nover, char **over) {
  for (int i = 0; i < nover; i++) {
    const char *eq = strchr(over[i], '=');
    size_t k = eq ? (size_t)(eq - over[i]) : strlen(over[i]);
    if (strncmp(entry, over[i], k) == 0 && entry[k] == '=') return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s <n> <program> [KEY=VALUE ...]\n", argv[0]);
    return 64;
  }
  int n = atoi(argv[1]);
  char *prog = argv[2];
  int nover = argc - 3;
  char **over = argv + 3;
  size_t nenv = 0;
  while (environ[nenv]) nenv++;
  char **envp = calloc(nenv + nover + 1, sizeof(char *));
  size_t k = 0;
  for (size_t i = 0; i < nenv; i++)
    if (!overridden(environ[i], nover, over)) envp[k++] = environ[i];
  for (int i = 0; i < nover; i++) envp[k++] = over[i];
  envp[k] = NULL;

  char *cargv[] = {prog, NULL};
  int failures = 0;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < n; i++) {
    pid_t pid;
    int rc = posix_spawn(&pid, prog, NULL, NULL, cargv, envp);
    if (rc != 0) {
      failures++;
      continue;
    }
    int st = 0;
    if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) failures++;
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  double us = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3 / n;
  printf("runs=%d\nmean_us=%.1f\nfailures=%d\n", n, us, failures);
  free(envp);
  return failures ? 1 : 0;
}
