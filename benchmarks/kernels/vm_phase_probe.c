// Which phase is this VM in? Every half second, for SECONDS: the round trip of a cache line bounced between
// two threads pinned to CPUs 0 and 1 (ns), and the read bandwidth of both threads streaming 512 MiB (GB/s).
//
// On a 2-vCPU cloud VM the host places the two vCPUs on cores of one CCD (chiplet) or of two, and moves them:
// on one CCD the threads share its link to memory (a Zen 4: ~35 GB/s, round trip ~80 ns through the shared
// L3); on two they have a link each (~56 GB/s, round trip ~350 ns across the I/O die). A memory-bound decode
// step follows the bandwidth (docs/performance.md, "The VM's two phases"); single_stream.py's
// --bandwidth-probe tags its rounds with the bandwidth alone, this program shows the placement behind it.
//
//     gcc -O3 -march=native -pthread -o /tmp/vm_phase_probe benchmarks/kernels/vm_phase_probe.c
//     flock /tmp/tokenloom-bench.lock /tmp/vm_phase_probe 150 > docs/figures/vm_phase_probe_zen4.jsonl
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kBounces = 200000, kReadReps = 3 };
static const long kBufferBytes = 512L << 20;

static _Atomic long ball __attribute__((aligned(64)));  // the bounced cache line: odd = CPU 1's turn
static atomic_int stop_bouncing;
static char *buffer;
static long sink[2];  // the readers' sums, kept so that the reads are not optimised away

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *bounce_back(void *unused) {  // on CPU 1: answer each odd value with the next even one
  (void)unused;
  pin_to(1);
  for (long expect = 1; !atomic_load(&stop_bouncing);)
    if (atomic_load(&ball) == expect) {
      atomic_store(&ball, expect + 1);
      expect += 2;
    }
  return NULL;
}

static double round_trip_ns(void) {
  atomic_store(&stop_bouncing, 0);
  atomic_store(&ball, 0);
  pthread_t peer;
  pthread_create(&peer, NULL, bounce_back, NULL);
  pin_to(0);
  double t0 = now_s();
  for (long v = 0; v < 2L * kBounces; v += 2) {
    atomic_store(&ball, v + 1);
    while (atomic_load(&ball) != v + 2) {
    }
  }
  double ns = (now_s() - t0) / kBounces * 1e9;
  atomic_store(&stop_bouncing, 1);
  pthread_join(peer, NULL);
  return ns;
}

static void *read_half(void *arg) {  // thread i reads half i of the buffer, pinned to CPU i
  long i = (long)arg;
  pin_to((int)i);
  const long *p = (const long *)(buffer + i * kBufferBytes / 2);
  long sum = 0;
  for (long k = 0; k < kBufferBytes / 2 / (long)sizeof(long); k++)  // every word: -O3 makes it vector loads
    sum += p[k];
  sink[i] = sum;
  return NULL;
}

static double read_gbs(void) {
  double best = 1e30;
  for (int r = 0; r < kReadReps; r++) {
    pthread_t a, b;
    double t0 = now_s();
    pthread_create(&a, NULL, read_half, (void *)0);
    pthread_create(&b, NULL, read_half, (void *)1);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    double dt = now_s() - t0;
    if (dt < best) best = dt;
  }
  return kBufferBytes / best / 1e9;
}

int main(int argc, char **argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 60;
  buffer = aligned_alloc(2L << 20, kBufferBytes);
  madvise(buffer, kBufferBytes, MADV_HUGEPAGE);  // as the engine's weights: 4 KiB pages would add TLB misses
  memset(buffer, 1, kBufferBytes);
  double start = now_s();
  while (now_s() - start < seconds) {
    double t = now_s() - start, rt = round_trip_ns(), gbs = read_gbs();
    printf("{\"t\": %.1f, \"round_trip_ns\": %.0f, \"read_gbs\": %.1f}\n", t, rt, gbs);
    fflush(stdout);
    nanosleep(&(struct timespec){0, 400000000}, NULL);
  }
  return (int)(sink[0] + sink[1] == 42);  // 0 in practice: uses the sums
}
