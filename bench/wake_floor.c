// The floor of a relayed fan-out without mesharray: one controller, R relays (processes) of K
// children each, a 64-byte message to every child per operation; the p50 wall time of an operation
// and the machine's CPU per child (/proc/stat). The controller talks to the relays over unix
// sockets; MODE says how a relay reaches its children and learns that they are done:
//
//   0  socket to each child, each answers on its socket   (a relayed call() today)
//   1  shared memory and one FUTEX_WAKE for all; a shared counter, the last child wakes the relay
//   2  socket to each child; the shared counter            (a relayed 1-element sum today)
//   3  shared memory and one FUTEX_WAKE; each answers on its socket
//   4  socket to each child, then one FUTEX_WAKE (children sleep on the futex, read the socket
//      without blocking); the shared counter
//   5  as 4; each answers on its socket
//
//   cc -O2 -o /tmp/wake_floor bench/wake_floor.c && /tmp/wake_floor MODE [RELAYS [OPS]]
//
// (bench/README.md, "Scale", session 49, has the figures; docs/scale.md what they say.)
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <poll.h>
#include <time.h>
#include <stdint.h>
#include <signal.h>

#define MAX_RELAYS 1024
static int R = 16, K = 64, ITERS = 300, MODE = 0;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static long futex(uint32_t *a, int op, uint32_t v) { return syscall(SYS_futex, a, op, v, NULL, NULL, 0); }
struct host { uint32_t seq; uint32_t pad[15]; uint32_t done; uint32_t pad2[15]; uint32_t relay_wait; };

static void child_sock(int s) {
  char buf[64];
  for (;;) { ssize_t n = recv(s, buf, 64, 0); if (n <= 0) _exit(0); if (send(s, buf, 64, 0) != 64) _exit(0); }
}
static void child_futex(struct host *h) {
  uint32_t last = 0;
  for (;;) {
    uint32_t s;
    while ((s = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE)) == last) futex(&h->seq, FUTEX_WAIT, last);
    if (s == 0xffffffff) _exit(0);
    last = s;
    if (__atomic_add_fetch(&h->done, 1, __ATOMIC_ACQ_REL) == (uint32_t)K) {
      __atomic_store_n(&h->relay_wait, 1, __ATOMIC_RELEASE); futex(&h->relay_wait, FUTEX_WAKE, 1);
    }
  }
}
static void child_sock_futex(int s, struct host *h) {
  char buf[64];
  for (;;) { ssize_t n = recv(s, buf, 64, 0); if (n <= 0) _exit(0);
    if (__atomic_add_fetch(&h->done, 1, __ATOMIC_ACQ_REL) == (uint32_t)K) {
      __atomic_store_n(&h->relay_wait, 1, __ATOMIC_RELEASE); futex(&h->relay_wait, FUTEX_WAKE, 1); } }
}
static void child_futex_sock(int sk, struct host *h) {
  uint32_t last = 0; char buf[64] = {0};
  for (;;) {
    uint32_t s;
    while ((s = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE)) == last) futex(&h->seq, FUTEX_WAIT, last);
    if (s == 0xffffffff) _exit(0);
    last = s;
    if (send(sk, buf, 64, 0) != 64) _exit(0);
  }
}
// mode 4/5: data on the socket, the wake by the host's futex: the child reads the seq, tries a
// non-blocking recv, and sleeps on the futex only when nothing is there
static void child_doorbell(int sk, struct host *h, int reply_sock) {
  char buf[64] = {0};
  for (;;) {
    uint32_t s = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
    ssize_t n = recv(sk, buf, 64, MSG_DONTWAIT);
    if (n == 0) _exit(0);
    if (n < 0) { futex(&h->seq, FUTEX_WAIT, s); continue; }
    if (reply_sock) { if (send(sk, buf, 64, 0) != 64) _exit(0); }
    else if (__atomic_add_fetch(&h->done, 1, __ATOMIC_ACQ_REL) == (uint32_t)K) {
      __atomic_store_n(&h->relay_wait, 1, __ATOMIC_RELEASE); futex(&h->relay_wait, FUTEX_WAKE, 1); }
  }
}
static void relay(int up, struct host *h) {
  int socks[K];
  for (int i = 0; i < K; i++) {
    int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    pid_t p = fork();
    if (p == 0) { close(sv[0]); close(up); for (int j = 0; j < i; j++) close(socks[j]);  // (a child holds its own end only)
      if (MODE == 0) child_sock(sv[1]); else if (MODE == 1) child_futex(h); else if (MODE == 2) child_sock_futex(sv[1], h); else if (MODE == 3) child_futex_sock(sv[1], h); else child_doorbell(sv[1], h, MODE == 5); }
    close(sv[1]); socks[i] = sv[0];
  }
  char buf[64];
  struct pollfd pf[K];
  for (;;) {
    ssize_t n = recv(up, buf, 64, 0);
    if (n <= 0) break;
    if (MODE == 2 || MODE == 4) {
      __atomic_store_n(&h->done, 0, __ATOMIC_RELEASE);
      __atomic_store_n(&h->relay_wait, 0, __ATOMIC_RELEASE);
      for (int i = 0; i < K; i++) send(socks[i], buf, 64, 0);
      if (MODE == 4) { __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL); futex(&h->seq, FUTEX_WAKE, 0x7fffffff); }
      while (__atomic_load_n(&h->relay_wait, __ATOMIC_ACQUIRE) == 0) futex(&h->relay_wait, FUTEX_WAIT, 0);
    } else if (MODE == 0 || MODE == 3 || MODE == 5) {
      if (MODE == 0 || MODE == 5) for (int i = 0; i < K; i++) send(socks[i], buf, 64, 0);
      if (MODE == 5) { __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL); futex(&h->seq, FUTEX_WAKE, 0x7fffffff); }
      else { __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL); futex(&h->seq, FUTEX_WAKE, 0x7fffffff); }
      int got = 0; char seen[K]; memset(seen, 0, K);
      while (got < K) {
        int m = 0; int idx[K];
        for (int i = 0; i < K; i++) if (!seen[i]) { pf[m].fd = socks[i]; pf[m].events = POLLIN; idx[m++] = i; }
        poll(pf, m, -1);
        for (int j = 0; j < m; j++) if (pf[j].revents & POLLIN) { recv(socks[idx[j]], buf, 64, 0); seen[idx[j]] = 1; got++; }
      }
    } else {
      __atomic_store_n(&h->done, 0, __ATOMIC_RELEASE);
      __atomic_store_n(&h->relay_wait, 0, __ATOMIC_RELEASE);
      __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL);
      futex(&h->seq, FUTEX_WAKE, 0x7fffffff);
      while (__atomic_load_n(&h->relay_wait, __ATOMIC_ACQUIRE) == 0) futex(&h->relay_wait, FUTEX_WAIT, 0);
    }
    send(up, buf, 64, 0);
  }
  if (MODE == 1 || MODE == 3) { __atomic_store_n(&h->seq, 0xffffffff, __ATOMIC_RELEASE); futex(&h->seq, FUTEX_WAKE, 0x7fffffff); }
  for (int i = 0; i < K; i++) close(socks[i]);
  if (MODE >= 4) { __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL); futex(&h->seq, FUTEX_WAKE, 0x7fffffff); }
  while (wait(NULL) > 0) {}
  _exit(0);
}
static int cmp(const void *a, const void *b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  if (argc > 1) MODE = atoi(argv[1]);
  if (argc > 2) R = atoi(argv[2]);
  if (argc > 3) ITERS = atoi(argv[3]);
  if (MODE < 0 || MODE > 5 || R < 1 || R > MAX_RELAYS || ITERS < 10) {
    fprintf(stderr, "usage: wake_floor MODE(0-5) [RELAYS(1-%d) [OPS(>=10)]]\n", MAX_RELAYS);
    return 2;
  }
  struct host *hs = mmap(NULL, sizeof(struct host) * R, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int up[R];
  for (int r = 0; r < R; r++) {
    int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    if (fork() == 0) { close(sv[0]); for (int j = 0; j < r; j++) close(up[j]); relay(sv[1], &hs[r]); }
    close(sv[1]); up[r] = sv[0];
  }
  sleep(1);
  double *w = malloc(sizeof(double) * ITERS); char buf[64] = {0};
  struct pollfd pf[R];
  FILE *f = fopen("/proc/stat", "r"); unsigned long long a[10], b[10];
  for (int it = -20; it < ITERS; it++) {
    if (it == 0) { rewind(f); fscanf(f, "cpu %llu %llu %llu %llu", &a[0], &a[1], &a[2], &a[3]); }
    double t0 = now();
    for (int r = 0; r < R; r++) send(up[r], buf, 64, 0);
    int got = 0; char seen[MAX_RELAYS] = {0};
    while (got < R) {
      int m = 0, idx[R];
      for (int r = 0; r < R; r++) if (!seen[r]) { pf[m].fd = up[r]; pf[m].events = POLLIN; idx[m++] = r; }
      poll(pf, m, -1);
      for (int j = 0; j < m; j++) if (pf[j].revents & POLLIN) { recv(up[idx[j]], buf, 64, 0); seen[idx[j]] = 1; got++; }
    }
    if (it >= 0) w[it] = now() - t0;
  }
  f = freopen("/proc/stat", "r", f); fscanf(f, "cpu %llu %llu %llu %llu", &b[0], &b[1], &b[2], &b[3]);
  double busy = ((b[0]+b[1]+b[2]) - (a[0]+a[1]+a[2])) / (double)sysconf(_SC_CLK_TCK);
  qsort(w, ITERS, sizeof(double), cmp);
  printf("%s R=%d K=%d: p50 %.2f ms p10 %.2f p90 %.2f; machine CPU per op %.2f ms (%.1f us per rank)\n", (const char*[]){"sock fwd + sock reply", "futex fwd + futex done", "sock fwd + futex done", "futex fwd + sock reply", "sock data+doorbell, futex done", "sock data+doorbell, sock reply"}[MODE], R, K,
         w[ITERS/2]*1e3, w[ITERS/10]*1e3, w[ITERS*9/10]*1e3, busy / ITERS * 1e3, busy / ITERS / (R*K) * 1e6);
  for (int r = 0; r < R; r++) close(up[r]);
  while (wait(NULL) > 0) {}
  return 0;
}
