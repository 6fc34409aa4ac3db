/* A TCP proxy that delays every byte by a fixed time, in both directions: tests/delay_proxy.py's
 * job (netem is not in this kernel) at a few microseconds of CPU per message instead of Python's
 * hundreds, so that on a 2-core machine the proxies take next to nothing from the workers they
 * stand between (bench/bench_plan.py's gbit-3ms setup).
 *
 *     cc -O2 -o delay_proxy bench/delay_proxy.c
 *     ./delay_proxy LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS     (prints "ready" once it listens)
 *
 * One thread, epoll. Each direction of each connection is a queue of (due time, bytes): what is
 * read is stamped now + delay and written when due (a timerfd wakes the loop at the earliest due
 * time), so order is kept and throughput is not throttled by the delay. An end of stream is
 * passed on (shutdown) when due; a connection goes when both directions have ended.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536
#define MAX_CONNS 256

struct piece {
    int64_t due;   /* ns, CLOCK_MONOTONIC */
    size_t len, off;
    int eof;       /* the source ended: shut the destination's writing side when due */
    struct piece *next;
    char data[];
};

struct dir {       /* bytes from src to dst */
    int src, dst;
    struct piece *head, *tail;
    int src_done, dst_done;
};

struct conn {
    int used;
    struct dir d[2];   /* d[0]: client -> target, d[1]: target -> client */
    uint32_t watched[2];  /* what epoll watches on the client's fd (0) and the target's (1) */
    int blocked[2];       /* direction k's destination would block */
};

static struct conn conns[MAX_CONNS];
static int64_t delay_ns;
static int ep, tfd;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int parse(const char *s, struct sockaddr_in *a) {
    char host[256];
    const char *colon = strrchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof host) return -1;
    memcpy(host, s, colon - s);
    host[colon - s] = 0;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)atoi(colon + 1));
    return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

static void watch(int fd, uint32_t events, uint64_t tag, int op) {
    struct epoll_event e = {.events = events, .data.u64 = tag};
    epoll_ctl(ep, op, fd, &e);
}

/* tags: 0 listener, 1 timer, else (conn index + 1) << 2 | which fd (0 client, 1 target) */
static uint64_t tag_of(int c, int side) { return ((uint64_t)(c + 1) << 2) | (uint64_t)side; }

static void arm_timer(void) {
    int64_t first = INT64_MAX;
    for (int c = 0; c < MAX_CONNS; c++)
        for (int k = 0; k < 2; k++)
            if (conns[c].used && !conns[c].blocked[k] && conns[c].d[k].head &&
                conns[c].d[k].head->due < first)  /* (a blocked one waits for EPOLLOUT) */
                first = conns[c].d[k].head->due;
    struct itimerspec its = {0};
    if (first != INT64_MAX) {
        if (first <= 0) first = 1;
        its.it_value.tv_sec = first / 1000000000;
        its.it_value.tv_nsec = first % 1000000000;
    }
    timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
}

static void drop(int c) {
    struct conn *cn = &conns[c];
    for (int k = 0; k < 2; k++) {
        struct piece *p = cn->d[k].head;
        while (p) {
            struct piece *n = p->next;
            free(p);
            p = n;
        }
    }
    close(cn->d[0].src);
    close(cn->d[0].dst);
    memset(cn, 0, sizeof *cn);
}

static void push(struct dir *d, const char *buf, size_t len, int eof) {
    struct piece *p = malloc(sizeof *p + len);
    if (!p) exit(1);
    p->due = now_ns() + delay_ns;
    p->len = len;
    p->off = 0;
    p->eof = eof;
    p->next = NULL;
    if (len) memcpy(p->data, buf, len);
    if (d->tail) d->tail->next = p; else d->head = p;
    d->tail = p;
}

/* write what is due; returns 1 when the destination would block */
static int flush(struct dir *d, int64_t now) {
    while (d->head && d->head->due <= now) {
        struct piece *p = d->head;
        if (p->eof) {
            shutdown(d->dst, SHUT_WR);
            d->dst_done = 1;
        } else {
            while (p->off < p->len) {
                ssize_t n = send(d->dst, p->data + p->off, p->len - p->off, MSG_NOSIGNAL);
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
                if (n <= 0) { d->dst_done = d->src_done = 1; break; }
                p->off += (size_t)n;
            }
        }
        d->head = p->next;
        if (!d->head) d->tail = NULL;
        free(p);
    }
    return 0;
}

/* fd of side s (0 client, 1 target) is the source of direction s and the destination of 1 - s */
static void rewatch(int c, int side) {
    struct conn *cn = &conns[c];
    uint32_t want = (cn->d[side].src_done ? 0 : EPOLLIN) | (cn->blocked[1 - side] ? EPOLLOUT : 0);
    if (want == cn->watched[side]) return;
    int fd = cn->d[side].src;
    if (!want) watch(fd, 0, 0, EPOLL_CTL_DEL);  /* (a hung-up fd would report EPOLLHUP forever) */
    else watch(fd, want, tag_of(c, side), cn->watched[side] ? EPOLL_CTL_MOD : EPOLL_CTL_ADD);
    cn->watched[side] = want;
}

static void service(int c, int64_t now) {
    struct conn *cn = &conns[c];
    for (int k = 0; k < 2; k++) cn->blocked[k] = flush(&cn->d[k], now);
    for (int side = 0; side < 2; side++) rewatch(c, side);
    if (cn->d[0].dst_done && cn->d[1].dst_done && !cn->d[0].head && !cn->d[1].head) drop(c);
}

static void accept_one(int lfd, const struct sockaddr_in *target) {
    int a = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
    if (a < 0) return;
    int t = socket(AF_INET, SOCK_STREAM, 0);
    if (t < 0 || connect(t, (const struct sockaddr *)target, sizeof *target) < 0) {
        close(a);
        if (t >= 0) close(t);
        return;
    }
    int one = 1, c;
    for (c = 0; c < MAX_CONNS && conns[c].used; c++) {}
    if (c == MAX_CONNS) { close(a); close(t); return; }
    setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(t, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct conn *cn = &conns[c];
    memset(cn, 0, sizeof *cn);
    cn->used = 1;
    cn->d[0].src = a; cn->d[0].dst = t;
    cn->d[1].src = t; cn->d[1].dst = a;
    fcntl(t, F_SETFL, fcntl(t, F_GETFL) | O_NONBLOCK);  /* connected blocking: local and quick */
    rewatch(c, 0);
    rewatch(c, 1);
}

int main(int argc, char **argv) {
    struct sockaddr_in listen_at, target;
    if (argc != 4 || parse(argv[1], &listen_at) || parse(argv[2], &target)) {
        fprintf(stderr, "usage: %s LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS (IPv4)\n", argv[0]);
        return 2;
    }
    delay_ns = (int64_t)(atof(argv[3]) * 1e6);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&listen_at, sizeof listen_at) || listen(lfd, 64)) {
        fprintf(stderr, "cannot listen on %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    ep = epoll_create1(0);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    watch(lfd, EPOLLIN, 0, EPOLL_CTL_ADD);
    watch(tfd, EPOLLIN, 1, EPOLL_CTL_ADD);
    printf("ready\n");
    fflush(stdout);
    char buf[CHUNK];
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(ep, evs, 64, -1);
        if (n < 0 && errno == EINTR) continue;
        int64_t now = now_ns();
        for (int i = 0; i < n; i++) {
            uint64_t tag = evs[i].data.u64;
            if (tag == 0) { accept_one(lfd, &target); continue; }
            if (tag == 1) { uint64_t x; ssize_t r = read(tfd, &x, sizeof x); (void)r; continue; }
            int c = (int)(tag >> 2) - 1, side = (int)(tag & 3);
            if (c < 0 || c >= MAX_CONNS || !conns[c].used) continue;
            struct dir *d = &conns[c].d[side];  /* side 0: client's fd is d[0]'s source */
            if ((evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !d->src_done) {
                ssize_t r = recv(d->src, buf, sizeof buf, 0);
                if (r > 0) push(d, buf, (size_t)r, 0);
                else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
                    d->src_done = 1;
                    push(d, NULL, 0, 1);
                }
            }
        }
        for (int c = 0; c < MAX_CONNS; c++)
            if (conns[c].used) service(c, now_ns());
        arm_timer();
        (void)now;
    }
}
