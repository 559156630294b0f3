/* The machine's floor with no interpreter: what bench/_floors.py measures in Python, in C.
 *
 *     cc -O2 -o floor bench/_floor.c && ./floor K N [py]
 *
 * K forked children, one unix socketpair each, echo 64 bytes; the parent sends 64 bytes to
 * all K and reads the K answers in one poll() loop, N times. Prints the median round trip in
 * microseconds (after 200 warm-up rounds). bench/ab.py builds and runs it when a C compiler
 * is there: the kernel's and the machine's wake-ups alone, beside the Python floors.
 * The children run in mesharray's workers' scheduling class: SCHED_BATCH on Linux (a woken
 * child does not preempt the parent), unless MESHARRAY_WORKER_SCHED=normal.
 * With "py", each child execs a Python echo loop ($PYTHON, default python3): the least a
 * runtime with a compiled controller and Python actors can take.
 */
#define _GNU_SOURCE
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MSG 64
#define WARM 200

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void echo(int fd) {
    char buf[256];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0) _exit(0);
        if (send(fd, buf, MSG, 0) != MSG) _exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "py") == 0)) {
        fprintf(stderr, "usage: %s K N [py]\n", argv[0]);
        return 2;
    }
    int py = argc == 4;
    int k = atoi(argv[1]), n = atoi(argv[2]);
    if (k < 1 || k > 256 || n <= WARM) {
        fprintf(stderr, "need 1 <= K <= 256 and N > %d, got K=%d N=%d\n", WARM, k, n);
        return 2;
    }
    int *fds = calloc(k, sizeof *fds);
    pid_t *pids = calloc(k, sizeof *pids);
    struct pollfd *pfd = calloc(k, sizeof *pfd);
    double *ts = calloc(n, sizeof *ts);
    if (!fds || !pids || !pfd || !ts) return 1;
    for (int j = 0; j < k; j++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) { perror("socketpair"); return 1; }
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 1; }
        if (pid == 0) {
#ifdef SCHED_BATCH
            const char *cls = getenv("MESHARRAY_WORKER_SCHED");
            if (!cls || strcasecmp(cls, "normal") != 0) {
                struct sched_param sp = {0};
                sched_setscheduler(0, SCHED_BATCH, &sp);
            }
#endif
            close(sv[0]);
            for (int i = 0; i < j; i++) close(fds[i]);
            if (py) {
                const char *python = getenv("PYTHON") ? getenv("PYTHON") : "python3";
                if (dup2(sv[1], 3) != 3) _exit(1);
                execlp(python, python, "-c",
                       "import socket\ns = socket.socket(fileno=3)\nb = bytearray(256)\n"
                       "while s.recv_into(b):\n    s.send(b[:64])\n", (char *)0);
                _exit(1);
            }
            echo(sv[1]);
        }
        close(sv[1]);
        fds[j] = sv[0];
        pids[j] = pid;
        pfd[j].fd = sv[0];
        pfd[j].events = POLLIN;
    }
    char msg[MSG], buf[256];
    memset(msg, 'x', sizeof msg);
    for (int i = 0; i < n; i++) {
        double t = now_us();
        for (int j = 0; j < k; j++)
            if (send(fds[j], msg, MSG, 0) != MSG) { perror("send"); return 1; }
        int left = k;
        if (k == 1) {
            if (recv(fds[0], buf, sizeof buf, 0) <= 0) { perror("recv"); return 1; }
            left = 0;
        }
        while (left > 0) {
            if (poll(pfd, k, -1) < 0) { perror("poll"); return 1; }
            for (int j = 0; j < k; j++) {
                if (pfd[j].revents & (POLLIN | POLLHUP | POLLERR)) {
                    if (recv(fds[j], buf, sizeof buf, 0) <= 0) { perror("recv"); return 1; }
                    left--;
                }
            }
        }
        ts[i] = now_us() - t;
    }
    for (int j = 0; j < k; j++) close(fds[j]);
    for (int j = 0; j < k; j++) waitpid(pids[j], NULL, 0);
    qsort(ts + WARM, n - WARM, sizeof *ts, cmp);
    printf("%.2f\n", ts[WARM + (n - WARM) / 2]);
    return 0;
}
