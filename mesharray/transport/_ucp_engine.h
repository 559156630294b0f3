/* The native half of mesharray's UCX data plane (included by _ucp.pyx; C99 + pthreads + epoll).
 *
 * One engine per plane: a UCP context and a worker in multi-thread mode, and a progress thread
 * that never touches Python. Whoever waits drives the worker (leader/follower): a thread waiting
 * for its request leads if nobody does (progress; arm; epoll on the worker's event fd), others
 * sleep on a condition variable of their own and are woken after every pass that did something.
 * The progress thread leads only while no caller has waited for a grace period, and steps down
 * as soon as a caller asks (want_lead + the wake eventfd). Every leader, after each progress pass,
 * runs eng_service(): Buffer requests from other processes are answered there, in C, so a read
 * of this process's memory never needs this process's Python.
 *
 * Tags: 64 bits = link id (48: table slot << 32 | 32 random bits, chosen by the receiving side
 * and given to the peer during the authenticated handshake) | sequence (8) | kind (8). Each side
 * of a link owns an endpoint to the other's worker (created from the worker address exchanged in
 * the handshake); messages are matched worker-wide by tag, so the random id is what keeps one
 * link's messages apart from another's.
 *
 * Locks: e->lock (leadership, followers), e->qlock (link and region tables, region state). No
 * UCP call is made while holding either, and UCP callbacks take neither: a callback only stores
 * the status into the ma_op its request was posted with.
 */
#ifndef MESHARRAY_UCP_ENGINE_H
#define MESHARRAY_UCP_ENGINE_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define MA_MAX_LINKS 4096
#define MA_MAX_REGIONS (1 << 14)
#define MA_NREQ 8 /* Buffer requests this process can be receiving at once */
#define MA_NFIN 4
#define MA_ERRLEN 256

enum { K_DATA = 1, K_RING = 2, K_REQ = 3, K_REPLY = 4, K_RDATA = 5, K_WDATA = 6, K_FIN = 7 };
#define MA_TAG(id, seq, kind) (((uint64_t)(id) << 16) | ((uint64_t)((seq)&0xffu) << 8) | (uint64_t)(kind))
#define MA_TAG_ID(tag) ((tag) >> 16)
#define MA_MASK_ALL ((uint64_t)-1)
#define MA_MASK_KIND ((uint64_t)0xff)

/* results of the waiting functions */
enum { MA_OK = 0, MA_DROPPED = 1, MA_ECONN = -1, MA_ETIMEOUT = -2, MA_ECLOSED = -3, MA_EINVAL = -4, MA_ENOMEM = -5 };

static int64_t ma_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void ma_abstime(int64_t t, struct timespec *ts) {
    ts->tv_sec = (time_t)(t / 1000000000LL);
    ts->tv_nsec = (long)(t % 1000000000LL);
}

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)

/* ------------------------------------------------------------------ one request */
typedef struct {
    int done;                /* set (release) by the callback, or at once for an immediate completion */
    ucs_status_t status;
    ucp_tag_recv_info_t info;
    void *req;               /* the UCP request, freed by whoever sees it done */
} ma_op;

static void ma_cb_send(void *request, ucs_status_t status, void *user_data) {
    ma_op *op = (ma_op *)user_data;
    (void)request;
    op->status = status;
    STORE(op->done, 1);
}

static void ma_cb_recv(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data) {
    ma_op *op = (ma_op *)user_data;
    (void)request;
    if (info != NULL) op->info = *info;
    op->status = status;
    STORE(op->done, 1);
}

static void ma_op_start(ma_op *op, ucs_status_ptr_t p) {
    if (p == NULL) {
        op->status = UCS_OK;
        op->req = NULL;
        STORE(op->done, 1);
    } else if (UCS_PTR_IS_ERR(p)) {
        op->status = UCS_PTR_STATUS(p);
        op->req = NULL;
        STORE(op->done, 1);
    } else {
        op->req = p;
    }
}

static void ma_op_release(ma_op *op) {
    if (op->req != NULL) {
        ucp_request_free(op->req);
        op->req = NULL;
    }
}

static int ma_op_done(ma_op *op) { return LOAD(op->done); }

static void ma_param_send(ucp_request_param_t *p, ma_op *op) {
    memset(op, 0, sizeof(*op));
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p->cb.send = ma_cb_send;
    p->user_data = op;
}

static void ma_param_recv(ucp_request_param_t *p, ma_op *op) {
    memset(op, 0, sizeof(*op));
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_RECV_INFO;
    p->cb.recv = ma_cb_recv;
    p->user_data = op;
    p->recv_info.tag_info = &op->info;
}

/* ------------------------------------------------------------------ engine, links, regions */
typedef struct ma_engine ma_engine;

typedef struct ma_link {
    ma_engine *eng;
    ucp_ep_h ep;
    uint64_t recv_id, send_id;
    int slot;
    int error;        /* a ucs_status_t from the error callback, 0 while healthy */
    int fin;          /* the peer closed its side (its FIN message came) */
    int closed;       /* closed here */
    int py_released;  /* the Python object is gone: the struct may be freed once nothing else holds it */
    int srv_refs;     /* served Buffer operations still using the link */
    int rma_native;   /* the endpoint has a transport that does RMA in hardware or the kernel */
    ma_op close_op;
    int closing;      /* close_op posted */
    unsigned seq;
    char *left;       /* bytes of a message received beyond what a recv_into asked for */
    size_t left_off, left_len;
    char *scratch;    /* the ring's reduction chunks, kept between calls (no page faults per call) */
    size_t scratch_len;
    struct ma_link *next_zombie;
} ma_link;

enum { R_LIVE = 1, R_DROPPED = 2 };

typedef struct {
    char *addr;
    size_t len;
    int readonly;
    int state;
    uint64_t token;
    uint64_t *token_word;     /* the owner's registry word for this block (zeroed by a drop from anywhere) */
    uint8_t secret[16];
    ucp_mem_h memh;
    int inflight;             /* served transfers using the block (under qlock) */
} ma_region;

/* the request a reader sends to a block's owner (little-endian, as both ends run this code) */
typedef struct {
    uint32_t magic;
    uint8_t op, seq;
    uint16_t pad;
    uint32_t slot, pad2;
    uint64_t token;
    uint8_t secret[16];
    uint64_t offset, nbytes;
    uint64_t pad3;
} ma_req_msg;  /* 64 bytes */

typedef struct {
    uint32_t magic, status;
    uint64_t nbytes;
} ma_rep_msg;

#define MA_MAGIC 0x3155414du /* "MAU1" */

typedef struct ma_ctrl {
    ma_op op;
    int kind;
    int posted;
    union {
        ma_req_msg req;
        uint64_t fin;
    } buf;
} ma_ctrl;

typedef struct ma_srv {
    struct ma_srv *next;
    ma_link *link;
    ma_region *region;
    int op;          /* 0 read, 1 write */
    int stage;
    unsigned seq;
    int64_t deadline;
    ma_op o[3];
    ma_rep_msg rep, rep2;
} ma_srv;

typedef struct ma_waiter {
    pthread_cond_t cv;
    struct ma_waiter *next;
} ma_waiter;

typedef int (*ma_done_fn)(void *arg);

struct ma_engine {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd, wakefd, epfd;
    pthread_mutex_t lock;
    pthread_cond_t idle_cv;
    int leader;               /* 0 nobody, 1 the progress thread, 2 a caller */
    int want_lead;            /* a caller asked the progress thread to step down */
    int waiters;
    uint64_t activity, gen;
    ma_waiter *followers;
    int nfollowers;
    int closing;
    int closed;
    int users;                /* calls from Python inside the engine (close waits for them) */
    pthread_t pt;
    int pt_started;
    int64_t grace_ns, spin_ns, srv_timeout_ns;
    int spin_misses;
    unsigned spin_tries;
    uint64_t progressed;
    uint64_t served;          /* Buffer requests answered by this engine */
    pthread_mutex_t qlock;
    ma_link *links[MA_MAX_LINKS];
    int nlinks;
    ma_region *regions[MA_MAX_REGIONS];
    ma_link *zombies;
    ma_ctrl reqs[MA_NREQ];
    ma_ctrl fins[MA_NFIN];
    ma_srv *srv;
    ucp_mem_h token_memh;
};

static void ma_err(char *err, const char *fmt, const char *what, ucs_status_t st) {
    if (err != NULL) snprintf(err, MA_ERRLEN, fmt, what, ucs_status_string(st));
}

/* every public entry: fails once the engine is closing; ma_engine_close waits for users to leave */
static int eng_enter(ma_engine *e) {
    __atomic_add_fetch(&e->users, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&e->closing, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&e->users, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

static void eng_leave(ma_engine *e) { __atomic_sub_fetch(&e->users, 1, __ATOMIC_SEQ_CST); }

static void eng_kick(ma_engine *e) {
    uint64_t one = 1;
    ssize_t r = write(e->wakefd, &one, sizeof(one));
    (void)r;
}

/* ------------------------------------------------------------------ served Buffer requests */
static void ctrl_post(ma_engine *e, ma_ctrl *c) {
    ucp_request_param_t p;
    ma_param_recv(&p, &c->op);
    void *buf = c->kind == K_REQ ? (void *)&c->buf.req : (void *)&c->buf.fin;
    size_t n = c->kind == K_REQ ? sizeof(c->buf.req) : sizeof(c->buf.fin);
    ma_op_start(&c->op, ucp_tag_recv_nbx(e->worker, buf, n, (uint64_t)c->kind, MA_MASK_KIND, &p));
    c->posted = 1;
}

static ma_link *link_of_tag(ma_engine *e, uint64_t tag) {
    uint64_t id = MA_TAG_ID(tag);
    unsigned slot = (unsigned)(id >> 32);
    ma_link *l = NULL;
    if (slot >= MA_MAX_LINKS) return NULL;
    pthread_mutex_lock(&e->qlock);
    l = e->links[slot];
    if (l != NULL && (l->recv_id != id || LOAD(l->closed) || LOAD(l->error))) l = NULL;
    if (l != NULL) l->srv_refs++;
    pthread_mutex_unlock(&e->qlock);
    return l;
}

static void link_unref(ma_engine *e, ma_link *l) {
    pthread_mutex_lock(&e->qlock);
    l->srv_refs--;
    pthread_mutex_unlock(&e->qlock);
}

static void srv_reply(ma_srv *s, ma_op *op, ma_rep_msg *rep, uint32_t status, uint64_t nbytes) {
    ucp_request_param_t p;
    ma_param_send(&p, op);
    rep->magic = MA_MAGIC;
    rep->status = status;
    rep->nbytes = nbytes;
    if (s->link->ep == NULL) { /* force-closed meanwhile: nothing to answer on */
        ma_op_start(op, UCS_STATUS_PTR(UCS_ERR_CONNECTION_RESET));
        return;
    }
    ma_op_start(op, ucp_tag_send_nbx(s->link->ep, rep, sizeof(*rep), MA_TAG(s->link->send_id, s->seq, K_REPLY), &p));
}

/* A request from a reader: check the capability (slot, token, secret) under qlock, then start it. */
static void srv_start(ma_engine *e, ma_link *l, const ma_req_msg *m) {
    ma_region *r = NULL;
    int ok = 0;
    ma_srv *s = (ma_srv *)calloc(1, sizeof(ma_srv));
    if (s == NULL) {
        link_unref(e, l);
        return;
    }
    s->link = l;
    s->seq = m->seq;
    s->op = m->op;
    s->deadline = ma_now() + e->srv_timeout_ns;
    pthread_mutex_lock(&e->qlock);
    if (m->magic == MA_MAGIC && m->slot < MA_MAX_REGIONS && (r = e->regions[m->slot]) != NULL) {
        int same = 0;
        for (int i = 0; i < 16; i++) same |= r->secret[i] ^ m->secret[i];
        ok = r->state == R_LIVE && r->token == m->token && r->token_word != NULL && *r->token_word == m->token
             && same == 0 && m->offset <= r->len && m->nbytes <= r->len - m->offset
             && (m->op == 0 || m->op == 2 || (m->op == 1 && !r->readonly));
    }
    if (ok && m->op == 2) {  /* a drop by a holder: the owner's registry releases the block at its next sweep */
        r->state = R_DROPPED;
        r->token = 0;
        *r->token_word = 0;
    } else if (ok) {
        r->inflight++;
    }
    pthread_mutex_unlock(&e->qlock);
    e->served++;
    if (!ok || m->op == 2) {
        s->stage = 9;  /* a reply and nothing else */
        srv_reply(s, &s->o[0], &s->rep, ok ? 0 : 1, 0);
        s->next = e->srv;
        e->srv = s;
        return;
    }
    s->region = r;
    ucp_request_param_t p;
    if (m->op == 0) {
        srv_reply(s, &s->o[0], &s->rep, 0, m->nbytes);
        if (m->nbytes && l->ep != NULL) {
            ma_param_send(&p, &s->o[1]);
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            p.memh = r->memh;
            ma_op_start(&s->o[1], ucp_tag_send_nbx(l->ep, r->addr + m->offset, m->nbytes,
                                                   MA_TAG(l->send_id, s->seq, K_RDATA), &p));
        } else {
            STORE(s->o[1].done, 1);
        }
        STORE(s->o[2].done, 1);
        s->stage = 1;
    } else {
        /* write: post the receive into the block first, then tell the writer to go */
        if (m->nbytes) {
            ma_param_recv(&p, &s->o[1]);
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            p.memh = r->memh;
            ma_op_start(&s->o[1], ucp_tag_recv_nbx(e->worker, r->addr + m->offset, m->nbytes,
                                                   MA_TAG(l->recv_id, s->seq, K_WDATA), MA_MASK_ALL, &p));
        } else {
            STORE(s->o[1].done, 1);
        }
        srv_reply(s, &s->o[0], &s->rep, 0, m->nbytes);
        s->stage = 2;
    }
    s->next = e->srv;
    e->srv = s;
}

static void link_force_close(ma_engine *e, ma_link *l);

/* Move served operations along; free the finished ones. Returns whether anything happened. */
static int srv_advance(ma_engine *e) {
    int did = 0;
    int64_t now = 0;
    ma_srv **pp = &e->srv;
    while (*pp != NULL) {
        ma_srv *s = *pp;
        int broken = LOAD(s->link->error) != 0 || LOAD(s->link->closed);
        if (s->stage == 2 && ma_op_done(&s->o[1])) {  /* the written bytes are in: say so */
            srv_reply(s, &s->o[2], &s->rep2, s->o[1].status == UCS_OK ? 0 : 2, s->o[1].info.length);
            s->stage = 3;
            did = 1;
        }
        int all;
        if (s->stage == 9)
            all = ma_op_done(&s->o[0]);
        else if (s->stage == 2)
            all = 0;
        else
            all = ma_op_done(&s->o[0]) && ma_op_done(&s->o[1]) && ma_op_done(&s->o[2]);
        if (!all && (s->stage == 2 || s->stage == 1 || s->stage == 3)) {
            if (now == 0) now = ma_now();
            if (s->stage == 2 && (broken || now > s->deadline) && !ma_op_done(&s->o[1]) && s->o[1].req != NULL) {
                /* a writer that went away or never sent: give the block back (the receive fails) */
                ucp_request_cancel(e->worker, s->o[1].req);
            } else if (s->stage != 2 && now > s->deadline && !broken) {
                /* a reader that stopped taking its bytes: a send cannot be cancelled, the endpoint
                 * can (every request on it completes); the reader opens a new link */
                if (LOAD(s->link->error) == 0) STORE(s->link->error, (int)UCS_ERR_TIMED_OUT);
                link_force_close(e, s->link);
            }
        }
        if (!all) {
            pp = &s->next;
            continue;
        }
        for (int i = 0; i < 3; i++) ma_op_release(&s->o[i]);
        if (s->region != NULL) {
            pthread_mutex_lock(&e->qlock);
            s->region->inflight--;
            pthread_mutex_unlock(&e->qlock);
        }
        link_unref(e, s->link);
        *pp = s->next;
        free(s);
        did = 1;
    }
    return did;
}

static void link_free(ma_link *l) {
    free(l->left);
    free(l->scratch);
    free(l);
}

/* The leader's work after each progress pass. Returns whether anything happened. */
static int eng_service(ma_engine *e) {
    int did = 0;
    for (int i = 0; i < MA_NREQ; i++) {
        ma_ctrl *c = &e->reqs[i];
        if (!c->posted || !ma_op_done(&c->op)) continue;
        ma_req_msg m = c->buf.req;
        ucs_status_t st = c->op.status;
        uint64_t tag = c->op.info.sender_tag;
        size_t len = c->op.info.length;
        ma_op_release(&c->op);
        c->posted = 0;
        if (LOAD(e->closing)) continue;
        ctrl_post(e, c);
        did = 1;
        if (st != UCS_OK || len != sizeof(m)) continue;
        ma_link *l = link_of_tag(e, tag);
        if (l != NULL) srv_start(e, l, &m);
    }
    for (int i = 0; i < MA_NFIN; i++) {
        ma_ctrl *c = &e->fins[i];
        if (!c->posted || !ma_op_done(&c->op)) continue;
        ucs_status_t st = c->op.status;
        uint64_t tag = c->op.info.sender_tag;
        ma_op_release(&c->op);
        c->posted = 0;
        if (LOAD(e->closing)) continue;
        ctrl_post(e, c);
        did = 1;
        if (st != UCS_OK) continue;
        ma_link *l = link_of_tag(e, tag);
        if (l != NULL) {
            STORE(l->fin, 1);
            link_unref(e, l);
        }
    }
    if (e->srv != NULL) did |= srv_advance(e);
    if (e->zombies != NULL) {
        pthread_mutex_lock(&e->qlock);
        ma_link **pp = &e->zombies;
        while (*pp != NULL) {
            ma_link *l = *pp;
            int close_done = !l->closing || ma_op_done(&l->close_op);
            if (close_done && l->closing) ma_op_release(&l->close_op);
            if (close_done) l->closing = 0;
            if (close_done && l->srv_refs == 0 && LOAD(l->py_released)) {
                *pp = l->next_zombie;
                link_free(l);
            } else {
                pp = &l->next_zombie;
            }
        }
        pthread_mutex_unlock(&e->qlock);
    }
    return did;
}

/* ------------------------------------------------------------------ leading and following */
static void eng_wake_followers(ma_engine *e) {
    if (LOAD(e->nfollowers) == 0) return;
    pthread_mutex_lock(&e->lock);
    e->gen++;
    for (ma_waiter *w = e->followers; w != NULL; w = w->next) pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&e->lock);
}

/* under e->lock: the lead is free; give it to the first follower. (The progress thread is not woken:
 * it looks by itself every grace period, so that a burst of calls costs it no wake-up per call.) */
static void eng_handoff_locked(ma_engine *e) {
    if (e->followers != NULL) pthread_cond_signal(&e->followers->cv);
}

enum { L_DONE = 0, L_TIMEOUT = 1, L_AGAIN = 2 };

static int eng_lead(ma_engine *e, ma_done_fn done, void *arg, int64_t deadline, int64_t spin_ns, int is_pt) {
    int64_t spin_end = 0;
    int spinning = 0;
    if (spin_ns > 0) {
        /* adaptive: after a run of spins that caught nothing, spin only every 32nd wait */
        e->spin_tries++;
        if (e->spin_misses < 8 || (e->spin_tries & 31) == 0) {
            spin_end = ma_now() + spin_ns;
            spinning = 1;
        }
    }
    for (;;) {
        unsigned n = ucp_worker_progress(e->worker);
        int s = eng_service(e);
        if (n || s) {
            e->progressed++;
            eng_wake_followers(e);
        }
        if (done(arg)) {
            if (spinning) e->spin_misses = 0;
            return L_DONE;
        }
        if (LOAD(e->closing) || (is_pt && LOAD(e->want_lead))) return L_AGAIN;
        if (n || s) continue;
        int64_t t = ma_now();
        if (spinning && t < spin_end) continue;
        if (spinning) {
            spinning = 0;
            if (e->spin_misses < 1000) e->spin_misses++;
        }
        if (deadline && t >= deadline) return L_TIMEOUT;
        ucs_status_t st = ucp_worker_arm(e->worker);
        if (st == UCS_ERR_BUSY) continue;
        int ms = 500;
        if (deadline) {
            int64_t left = (deadline - t + 999999) / 1000000;
            if (left < ms) ms = (int)left;
        }
        struct epoll_event ev[4];
        int k = epoll_wait(e->epfd, ev, 4, ms);
        for (int i = 0; i < k; i++) {
            if (ev[i].data.fd == e->wakefd) {
                uint64_t v;
                ssize_t r = read(e->wakefd, &v, sizeof(v));
                (void)r;
            }
        }
    }
}

/* Wait until done(arg), leading when nobody does. MA_OK, MA_ETIMEOUT (deadline passed) or MA_ECLOSED. */
static int eng_wait(ma_engine *e, ma_done_fn done, void *arg, int64_t deadline, int64_t spin_ns) {
    ma_waiter w;
    pthread_condattr_t ca;
    int rc = MA_OK;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w.cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_lock(&e->lock);
    e->waiters++;
    e->activity++;
    pthread_mutex_unlock(&e->lock);
    for (;;) {
        uint64_t gen = LOAD(e->gen);
        if (done(arg)) break;
        if (LOAD(e->closing)) {
            rc = MA_ECLOSED;
            break;
        }
        pthread_mutex_lock(&e->lock);
        if (e->leader == 0) {
            e->leader = 2;
            pthread_mutex_unlock(&e->lock);
            int r = eng_lead(e, done, arg, deadline, spin_ns, 0);
            pthread_mutex_lock(&e->lock);
            e->leader = 0;
            eng_handoff_locked(e);
            pthread_mutex_unlock(&e->lock);
            if (r == L_TIMEOUT) rc = MA_ETIMEOUT;
            if (r == L_AGAIN) rc = MA_ECLOSED;
            break;
        }
        if (e->leader == 1) {
            STORE(e->want_lead, 1);
            eng_kick(e);
        }
        if (LOAD(e->gen) != gen) {
            pthread_mutex_unlock(&e->lock);
            continue;
        }
        w.next = e->followers;
        e->followers = &w;
        __atomic_add_fetch(&e->nfollowers, 1, __ATOMIC_ACQ_REL);
        int64_t until = ma_now() + 100000000LL;
        if (deadline && deadline < until) until = deadline;
        struct timespec ts;
        ma_abstime(until, &ts);
        pthread_cond_timedwait(&w.cv, &e->lock, &ts);
        for (ma_waiter **pp = &e->followers; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == &w) {
                *pp = w.next;
                break;
            }
        }
        __atomic_sub_fetch(&e->nfollowers, 1, __ATOMIC_ACQ_REL);
        if (e->leader == 0) eng_handoff_locked(e); /* (another follower may be next in line) */
        pthread_mutex_unlock(&e->lock);
        if (deadline && ma_now() >= deadline && !done(arg)) {
            rc = MA_ETIMEOUT;
            break;
        }
    }
    pthread_mutex_lock(&e->lock);
    e->waiters--;
    e->activity++;
    pthread_mutex_unlock(&e->lock);
    pthread_cond_destroy(&w.cv);
    return rc;
}

static int pt_done(void *arg) {
    (void)arg;
    return 0;
}

static void *eng_progress_thread(void *arg) {
    ma_engine *e = (ma_engine *)arg;
    uint64_t seen = (uint64_t)-1;
    pthread_mutex_lock(&e->lock);
    while (!e->closing) {
        if (e->leader != 0 || e->waiters != 0 || e->activity != seen) {
            seen = e->activity;
            struct timespec ts;
            ma_abstime(ma_now() + e->grace_ns, &ts);
            pthread_cond_timedwait(&e->idle_cv, &e->lock, &ts);
            continue;
        }
        e->leader = 1;
        STORE(e->want_lead, 0);
        pthread_mutex_unlock(&e->lock);
        eng_lead(e, pt_done, e, 0, 0, 1);
        pthread_mutex_lock(&e->lock);
        e->leader = 0;
        STORE(e->want_lead, 0);
        eng_handoff_locked(e);
        seen = e->activity;
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

/* ------------------------------------------------------------------ engine life */
static ma_engine *ma_engine_new(int64_t grace_us, int64_t spin_us, int64_t srv_timeout_s, char *err) {
    ucp_config_t *config = NULL;
    ucp_params_t params;
    ucp_worker_params_t wp;
    ucp_worker_attr_t wa;
    ucs_status_t st;
    ma_engine *e = (ma_engine *)calloc(1, sizeof(ma_engine));
    if (e == NULL) {
        snprintf(err, MA_ERRLEN, "out of memory");
        return NULL;
    }
    e->efd = e->wakefd = e->epfd = -1;
    e->grace_ns = grace_us * 1000;
    e->spin_ns = spin_us * 1000;
    e->srv_timeout_ns = srv_timeout_s * 1000000000LL;
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        ma_err(err, "%s failed: %s", "ucp_config_read", st);
        goto fail;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    st = ucp_init(&params, config, &e->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        ma_err(err, "%s failed: %s", "ucp_init", st);
        goto fail;
    }
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI;
    st = ucp_worker_create(e->ctx, &wp, &e->worker);
    if (st != UCS_OK) {
        ma_err(err, "%s failed: %s", "ucp_worker_create", st);
        goto fail;
    }
    wa.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    if (ucp_worker_query(e->worker, &wa) == UCS_OK && wa.thread_mode != UCS_THREAD_MODE_MULTI) {
        snprintf(err, MA_ERRLEN, "this UCX was built without multi-thread support (worker thread mode %d)",
                 (int)wa.thread_mode);
        goto fail;
    }
    st = ucp_worker_get_efd(e->worker, &e->efd);
    if (st != UCS_OK) {
        ma_err(err, "%s failed: %s", "ucp_worker_get_efd", st);
        goto fail;
    }
    e->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (e->wakefd < 0 || e->epfd < 0) {
        snprintf(err, MA_ERRLEN, "eventfd/epoll_create1 failed: %s", strerror(errno));
        goto fail;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = e->efd;
    epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->efd, &ev);
    ev.data.fd = e->wakefd;
    epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->wakefd, &ev);
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->qlock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->idle_cv, &ca);
    pthread_condattr_destroy(&ca);
    for (int i = 0; i < MA_NREQ; i++) {
        e->reqs[i].kind = K_REQ;
        ctrl_post(e, &e->reqs[i]);
    }
    for (int i = 0; i < MA_NFIN; i++) {
        e->fins[i].kind = K_FIN;
        ctrl_post(e, &e->fins[i]);
    }
    if (pthread_create(&e->pt, NULL, eng_progress_thread, e) != 0) {
        snprintf(err, MA_ERRLEN, "cannot start the progress thread: %s", strerror(errno));
        goto fail;
    }
    e->pt_started = 1;
    return e;
fail:
    if (e->epfd >= 0) close(e->epfd);
    if (e->wakefd >= 0) close(e->wakefd);
    if (e->worker != NULL) ucp_worker_destroy(e->worker);
    if (e->ctx != NULL) ucp_cleanup(e->ctx);
    free(e);
    return NULL;
}

static int ma_engine_address(ma_engine *e, char **out, size_t *len) {
    ucp_address_t *a;
    size_t n;
    if (ucp_worker_get_address(e->worker, &a, &n) != UCS_OK) return MA_EINVAL;
    *out = (char *)malloc(n);
    if (*out == NULL) {
        ucp_worker_release_address(e->worker, a);
        return MA_ENOMEM;
    }
    memcpy(*out, a, n);
    *len = n;
    ucp_worker_release_address(e->worker, a);
    return MA_OK;
}

/* What ucp_context_print_info says (the resources: transports and devices UCX may use), malloc'd. */
static char *ma_engine_info(ma_engine *e) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (f == NULL) return NULL;
    ucp_context_print_info(e->ctx, f);
    fclose(f);
    return buf;
}

static int ma_all_done(void *arg) {
    ma_op **ops = (ma_op **)arg;
    for (; *ops != NULL; ops++)
        if (!ma_op_done(*ops)) return 0;
    return 1;
}

static void link_force_close(ma_engine *e, ma_link *l);

/* Stop the progress thread, close every link, unmap every block. The engine's memory stays until
 * ma_engine_free (Python objects may still point into it). Blocks until callers in C have left
 * (at most ~2 s; if one does not, the worker is kept rather than destroyed under it). */
static void ma_engine_close(ma_engine *e) {
    if (LOAD(e->closed)) return;
    pthread_mutex_lock(&e->lock);
    __atomic_store_n(&e->closing, 1, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&e->idle_cv);
    pthread_mutex_unlock(&e->lock);
    eng_kick(e);
    if (e->pt_started) pthread_join(e->pt, NULL);
    e->pt_started = 0;
    pthread_mutex_lock(&e->qlock);
    for (int i = 0; i < MA_MAX_LINKS; i++)
        if (e->links[i] != NULL) STORE(e->links[i]->closed, 1);
    pthread_mutex_unlock(&e->qlock);
    /* let the callers in C see their links closed and leave */
    int64_t until = ma_now() + 2000000000LL;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        e->gen++;
        for (ma_waiter *x = e->followers; x != NULL; x = x->next) pthread_cond_signal(&x->cv);
        pthread_mutex_unlock(&e->lock);
        if (__atomic_load_n(&e->users, __ATOMIC_SEQ_CST) == 0 || ma_now() > until) break;
        eng_kick(e);
        usleep(1000);
    }
    STORE(e->closed, 1);
    if (__atomic_load_n(&e->users, __ATOMIC_SEQ_CST) != 0) return; /* one is stuck in UCX: keep the worker */
    for (int i = 0; i < MA_MAX_LINKS; i++) {
        ma_link *l = e->links[i];
        if (l != NULL) {
            link_force_close(e, l);
            e->links[i] = NULL;
            l->next_zombie = e->zombies;
            e->zombies = l;
        }
    }
    for (int i = 0; i < MA_NREQ; i++)
        if (e->reqs[i].posted && !ma_op_done(&e->reqs[i].op)) ucp_request_cancel(e->worker, e->reqs[i].op.req);
    for (int i = 0; i < MA_NFIN; i++)
        if (e->fins[i].posted && !ma_op_done(&e->fins[i].op)) ucp_request_cancel(e->worker, e->fins[i].op.req);
    /* progress until every request of ours completed (cancelled ones complete too) */
    until = ma_now() + 2000000000LL;
    for (;;) {
        ucp_worker_progress(e->worker);
        srv_advance(e);
        int pending = e->srv != NULL;
        for (int i = 0; i < MA_NREQ; i++) pending |= e->reqs[i].posted && !ma_op_done(&e->reqs[i].op);
        for (int i = 0; i < MA_NFIN; i++) pending |= e->fins[i].posted && !ma_op_done(&e->fins[i].op);
        for (ma_link *l = e->zombies; l != NULL; l = l->next_zombie) pending |= l->closing && !ma_op_done(&l->close_op);
        if (!pending || ma_now() > until) break;
    }
    for (int i = 0; i < MA_NREQ; i++) ma_op_release(&e->reqs[i].op);
    for (int i = 0; i < MA_NFIN; i++) ma_op_release(&e->fins[i].op);
    /* take what came for links already closed (UCX warns about unmatched messages at destroy) */
    for (int k = 0; k < 100000; k++) {
        ucp_tag_recv_info_t info;
        ucp_tag_message_h m = ucp_tag_probe_nb(e->worker, 0, 0, 1, &info);
        if (m == NULL) break;
        char *tmp = (char *)malloc(info.length ? info.length : 1);
        if (tmp == NULL) break;
        ma_op op;
        ucp_request_param_t p;
        ma_param_recv(&p, &op);
        ma_op_start(&op, ucp_tag_msg_recv_nbx(e->worker, tmp, info.length, m, &p));
        int64_t t_end = ma_now() + 200000000LL;
        while (!ma_op_done(&op) && ma_now() < t_end) ucp_worker_progress(e->worker);
        if (!ma_op_done(&op)) {
            ucp_request_cancel(e->worker, op.req);
            t_end = ma_now() + 200000000LL;
            while (!ma_op_done(&op) && ma_now() < t_end) ucp_worker_progress(e->worker);
        }
        if (!ma_op_done(&op)) break; /* (leaks tmp and the op's request: UCX still holds them) */
        ma_op_release(&op);
        free(tmp);
    }
    for (ma_link *l = e->zombies; l != NULL; l = l->next_zombie)
        if (l->closing && ma_op_done(&l->close_op)) {
            ma_op_release(&l->close_op);
            l->closing = 0;
        }
    for (int i = 0; i < MA_MAX_REGIONS; i++) {
        ma_region *r = e->regions[i];
        if (r != NULL) {
            if (r->memh != NULL) ucp_mem_unmap(e->ctx, r->memh);
            free(r);
            e->regions[i] = NULL;
        }
    }
    if (e->token_memh != NULL) ucp_mem_unmap(e->ctx, e->token_memh);
    e->token_memh = NULL;
    if (e->srv == NULL) {
        ucp_worker_destroy(e->worker);
        ucp_cleanup(e->ctx);
        e->worker = NULL;
        e->ctx = NULL;
    }
    close(e->epfd);
    close(e->wakefd);
}

/* Free what is left (after ma_engine_close; no link of this engine may be used afterwards). */
static void ma_engine_free(ma_engine *e) {
    ma_engine_close(e);
    while (e->zombies != NULL) {
        ma_link *l = e->zombies;
        e->zombies = l->next_zombie;
        if (e->worker == NULL || !l->closing) link_free(l); /* (a close still pending in a kept worker: leak it) */
    }
    for (ma_srv *s = e->srv; s != NULL;) {
        ma_srv *n = s->next;
        if (e->worker == NULL) free(s);
        s = n;
    }
    if (e->worker == NULL) free(e);
}

/* ------------------------------------------------------------------ links */
static void ma_link_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    ma_link *l = (ma_link *)arg;
    (void)ep;
    STORE(l->error, (int)status);
}

/* A link slot with a fresh receive id (``rand32`` from the caller's random source). */
static ma_link *ma_link_new(ma_engine *e, uint32_t rand32, char *err) {
    if (LOAD(e->closed) || LOAD(e->closing)) {
        snprintf(err, MA_ERRLEN, "the UCX engine is closed");
        return NULL;
    }
    ma_link *l = (ma_link *)calloc(1, sizeof(ma_link));
    if (l == NULL) {
        snprintf(err, MA_ERRLEN, "out of memory");
        return NULL;
    }
    l->eng = e;
    pthread_mutex_lock(&e->qlock);
    int slot = -1;
    for (int i = 0; i < MA_MAX_LINKS; i++) {
        int k = (e->nlinks + i) % MA_MAX_LINKS;
        if (e->links[k] == NULL) {
            slot = k;
            break;
        }
    }
    if (slot >= 0) {
        e->links[slot] = l;
        e->nlinks = slot + 1;
    }
    pthread_mutex_unlock(&e->qlock);
    if (slot < 0) {
        free(l);
        snprintf(err, MA_ERRLEN, "too many UCX links in this process (at most %d)", MA_MAX_LINKS);
        return NULL;
    }
    l->slot = slot;
    l->recv_id = ((uint64_t)slot << 32) | (uint64_t)(rand32 ? rand32 : 1u);
    return l;
}

static const char *MA_NATIVE_RMA[] = {"rc_verbs", "rc_mlx5", "dc_mlx5", "rc_x", "dc_x", "cma", "knem", "xpmem",
                                      "cuda_ipc", "rocm_ipc", "gdr_copy", NULL};

/* The transports of the link's endpoint as "tl/device,..." into out; returns how many. */
static int ma_link_transports(ma_link *l, char *out, size_t outlen, int *native) {
    ucp_transport_entry_t ents[16];
    ucp_ep_attr_t attr;
    out[0] = 0;
    *native = 0;
    if (l->ep == NULL) return 0;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = ents;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    if (ucp_ep_query(l->ep, &attr) != UCS_OK) return 0;
    size_t used = 0;
    for (unsigned i = 0; i < attr.transports.num_entries && i < 16; i++) {
        int w = snprintf(out + used, outlen - used, "%s%s/%s", i ? "," : "", ents[i].transport_name,
                         ents[i].device_name);
        if (w < 0 || (size_t)w >= outlen - used) break;
        used += (size_t)w;
        for (const char **n = MA_NATIVE_RMA; *n != NULL; n++)
            if (strcmp(*n, ents[i].transport_name) == 0) *native = 1;
    }
    return (int)attr.transports.num_entries;
}

static int ma_link_connect(ma_link *l, const void *addr, size_t len, uint64_t send_id, char *err) {
    ucp_ep_params_t ep;
    (void)len;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ma_link_err_cb;
    ep.err_handler.arg = l;
    ucs_status_t st = ucp_ep_create(l->eng->worker, &ep, &l->ep);
    if (st != UCS_OK) {
        l->ep = NULL;
        ma_err(err, "%s failed: %s", "ucp_ep_create", st);
        return MA_ECONN;
    }
    l->send_id = send_id;
    char names[512];
    ma_link_transports(l, names, sizeof(names), &l->rma_native);
    return MA_OK;
}

static int link_broken(ma_link *l) { return LOAD(l->error) != 0 || LOAD(l->closed) || LOAD(l->eng->closing); }

static void link_reason(ma_link *l, char *err, const char *what) {
    if (LOAD(l->closed) || LOAD(l->eng->closing))
        snprintf(err, MA_ERRLEN, "the link was closed while %s", what);
    else if (LOAD(l->error))
        snprintf(err, MA_ERRLEN, "the link broke while %s: %s", what, ucs_status_string((ucs_status_t)l->error));
    else if (LOAD(l->fin))
        snprintf(err, MA_ERRLEN, "the peer closed the link while %s", what);
    else
        snprintf(err, MA_ERRLEN, "no progress while %s", what);
}

/* Force the endpoint closed: every request on it completes (with an error). */
static void link_force_close(ma_engine *e, ma_link *l) {
    if (l->ep == NULL || l->closing) return;
    ucp_request_param_t p;
    ma_param_send(&p, &l->close_op);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ma_op_start(&l->close_op, ucp_ep_close_nbx(l->ep, &p));
    l->closing = 1;
    l->ep = NULL;
    (void)e;
}

/* what a waiter on some requests of a link watches */
typedef struct {
    ma_op **ops;        /* NULL-terminated */
    ma_link *link;
    int64_t broken_at;  /* when the link was first seen broken */
} wait_ops;

static int wait_ops_done(void *arg) {
    wait_ops *w = (wait_ops *)arg;
    if (ma_all_done(w->ops)) return 1;
    if (w->link != NULL && link_broken(w->link) && w->broken_at == 0) return 1;
    return 0;
}

/* Wait, however long it takes, until UCX let go of every op (after a cancel or a forced close it
 * completes them promptly): an op's memory is on the caller's stack and must outlive its request. */
static void ops_drain(ma_engine *e, ma_op **ops) {
    wait_ops w = {ops, NULL, 0};
    while (!ma_all_done(ops)) {
        if (LOAD(e->closing)) {
            ucp_worker_progress(e->worker);
            usleep(100);
        } else {
            eng_wait(e, wait_ops_done, &w, ma_now() + 1000000000LL, 0);
        }
    }
}

/* Wait for ops; on a broken link or a timeout, cancel the receives among them (recv_mask bit i: ops[i]
 * is a receive) and force the link's endpoint closed, then wait until UCX let go of every buffer. */
static int link_wait_ops(ma_link *l, ma_op **ops, unsigned recv_mask, int64_t deadline, int64_t spin, char *err,
                         const char *what) {
    ma_engine *e = l->eng;
    wait_ops w = {ops, l, 0};
    int rc = eng_wait(e, wait_ops_done, &w, deadline, spin);
    if (ma_all_done(ops)) return MA_OK;
    if (rc == MA_ECLOSED || LOAD(e->closing)) {
        /* the engine is closing: it completes (or keeps) every request itself */
        snprintf(err, MA_ERRLEN, "the data plane was closed while %s", what);
        return MA_ECLOSED;
    }
    if (rc == MA_ETIMEOUT)
        snprintf(err, MA_ERRLEN, "no progress while %s before the deadline", what);
    else
        link_reason(l, err, what);
    /* give UCX a moment to fail the requests itself (a broken endpoint purges its sends) */
    w.broken_at = 1;
    w.link = NULL;
    eng_wait(e, wait_ops_done, &w, ma_now() + 200000000LL, 0);
    if (!ma_all_done(ops)) {
        for (int i = 0; ops[i] != NULL; i++)
            if ((recv_mask >> i) & 1u && !ma_op_done(ops[i]) && ops[i]->req != NULL)
                ucp_request_cancel(e->worker, ops[i]->req);
        if (!LOAD(l->closed)) {
            pthread_mutex_lock(&e->qlock);
            if (l->error == 0) STORE(l->error, (int)UCS_ERR_CANCELED);
            pthread_mutex_unlock(&e->qlock);
        }
        link_force_close(e, l);
        eng_kick(e);
        ops_drain(e, ops);
    }
    return rc == MA_ETIMEOUT ? MA_ETIMEOUT : MA_ECONN;
}

static int ma_link_send(ma_link *l, const void *buf, size_t n, int64_t timeout_ns, char *err) {
    if (n == 0) return MA_OK;
    if (link_broken(l) || l->ep == NULL) {
        link_reason(l, err, "sending");
        return LOAD(l->closed) ? MA_ECLOSED : MA_ECONN;
    }
    ma_op op;
    ucp_request_param_t p;
    ma_param_send(&p, &op);
    ma_op_start(&op, ucp_tag_send_nbx(l->ep, buf, n, MA_TAG(l->send_id, 0, K_DATA), &p));
    ma_op *ops[2] = {&op, NULL};
    int rc = ma_op_done(&op) ? MA_OK
                             : link_wait_ops(l, ops, 0, ma_now() + timeout_ns, n <= 65536 ? l->eng->spin_ns : 0, err,
                                             "sending");
    if (rc == MA_OK && op.status != UCS_OK) {
        ma_err(err, "%s: %s", "sending", op.status);
        if (LOAD(l->error) == 0) STORE(l->error, (int)op.status);
        rc = MA_ECONN;
    }
    if (ma_op_done(&op)) ma_op_release(&op);
    return rc;
}

typedef struct {
    ma_link *l;
    ucp_tag_message_h msg;
    ucp_tag_recv_info_t info;
} probe_state;

static int probe_done(void *arg) {
    probe_state *s = (probe_state *)arg;
    ma_link *l = s->l;
    s->msg = ucp_tag_probe_nb(l->eng->worker, MA_TAG(l->recv_id, 0, K_DATA), MA_MASK_ALL, 1, &s->info);
    if (s->msg != NULL) return 1;
    return link_broken(l) || LOAD(l->fin);
}

/* Fill buf[0:n] from the link's byte stream: messages are taken in order (probe, then receive
 * straight into buf); what a message holds beyond n waits in l->left for the next call. */
static int ma_link_recv(ma_link *l, char *buf, size_t n, int64_t timeout_ns, char *err) {
    size_t off = 0;
    int64_t deadline = ma_now() + timeout_ns;
    if (l->left != NULL) {
        size_t k = l->left_len - l->left_off;
        if (k > n) k = n;
        memcpy(buf, l->left + l->left_off, k);
        l->left_off += k;
        off = k;
        if (l->left_off == l->left_len) {
            free(l->left);
            l->left = NULL;
        }
    }
    while (off < n) {
        if (LOAD(l->closed) || LOAD(l->eng->closing)) {
            link_reason(l, err, "receiving");
            return MA_ECLOSED;
        }
        probe_state s;
        memset(&s, 0, sizeof(s));
        s.l = l;
        int rc = eng_wait(l->eng, probe_done, &s, deadline, n - off <= 65536 ? l->eng->spin_ns : 0);
        if (s.msg == NULL) {
            if (rc == MA_ETIMEOUT) {
                snprintf(err, MA_ERRLEN, "no data came before the deadline while receiving");
                return MA_ETIMEOUT;
            }
            /* broken or closed by the peer: one more look, for what came before the FIN */
            if (!probe_done(&s) || s.msg == NULL) {
                link_reason(l, err, "receiving");
                return LOAD(l->closed) ? MA_ECLOSED : MA_ECONN;
            }
        }
        size_t len = s.info.length;
        char *dst = buf + off;
        char *tmp = NULL;
        if (len > n - off) {
            tmp = (char *)malloc(len);
            if (tmp == NULL) {
                snprintf(err, MA_ERRLEN, "out of memory for a message of %zu bytes", len);
                return MA_ENOMEM;
            }
            dst = tmp;
        }
        ma_op op;
        ucp_request_param_t p;
        ma_param_recv(&p, &op);
        ma_op_start(&op, ucp_tag_msg_recv_nbx(l->eng->worker, dst, len, s.msg, &p));
        ma_op *ops[2] = {&op, NULL};
        rc = ma_op_done(&op) ? MA_OK : link_wait_ops(l, ops, 1, deadline, 0, err, "receiving");
        if (rc == MA_OK && op.status != UCS_OK) {
            ma_err(err, "%s: %s", "receiving", op.status);
            rc = MA_ECONN;
        }
        if (ma_op_done(&op)) ma_op_release(&op);
        if (rc != MA_OK) {
            free(tmp);
            return rc;
        }
        if (tmp != NULL) {
            memcpy(buf + off, tmp, n - off);
            l->left = tmp;
            l->left_off = n - off;
            l->left_len = len;
            off = n;
        } else {
            off += len;
        }
    }
    return MA_OK;
}

/* Close: tell the peer (FIN, after everything sent before it), flush and close the endpoint.
 * Waits at most timeout_ns for the flush; then forces. */
static void ma_link_close(ma_link *l, int64_t timeout_ns) {
    ma_engine *e = l->eng;
    if (LOAD(l->closed)) return;
    if (!LOAD(e->closing) && l->ep != NULL && LOAD(l->error) == 0) {
        static const uint64_t fin = 0x4e4946;
        ma_op op;
        ucp_request_param_t p;
        ma_param_send(&p, &op);
        ma_op_start(&op, ucp_tag_send_nbx(l->ep, &fin, sizeof(fin), MA_TAG(l->send_id, 0, K_FIN), &p));
        ma_op *ops[2] = {&op, NULL};
        wait_ops w = {ops, l, 0};
        if (!ma_op_done(&op)) eng_wait(e, wait_ops_done, &w, ma_now() + timeout_ns, 0);
        if (!ma_op_done(&op)) {
            link_force_close(e, l);
            ops_drain(e, ops);
        }
        ma_op_release(&op);
        if (l->ep != NULL && LOAD(l->error) == 0) {
            ma_param_send(&p, &l->close_op);
            ma_op_start(&l->close_op, ucp_ep_close_nbx(l->ep, &p)); /* flush: what was sent arrives */
            l->closing = 1;
            l->ep = NULL;
            ma_op *cops[2] = {&l->close_op, NULL};
            wait_ops cw = {cops, NULL, 0};
            if (!ma_op_done(&l->close_op)) eng_wait(e, wait_ops_done, &cw, ma_now() + timeout_ns, 0);
        }
    }
    if (!LOAD(e->closing)) link_force_close(e, l);
    pthread_mutex_lock(&e->qlock);
    STORE(l->closed, 1);
    if (!LOAD(e->closing) && e->links[l->slot] == l) {
        e->links[l->slot] = NULL;
        l->next_zombie = e->zombies;
        e->zombies = l;
    }
    pthread_mutex_unlock(&e->qlock);
    eng_kick(e);
}

/* The Python object is gone: the struct is freed by the next leader once nothing uses it. */
static void ma_link_release(ma_link *l) {
    ma_engine *e = l->eng;
    if (!LOAD(l->closed) && !LOAD(e->closing)) ma_link_close(l, 1000000000LL);
    pthread_mutex_lock(&e->qlock);
    STORE(l->py_released, 1);
    pthread_mutex_unlock(&e->qlock);
}

/* ------------------------------------------------------------------ registered blocks (the owner) */
static int ma_region_add(ma_engine *e, unsigned slot, void *addr, size_t len, int readonly, uint64_t token,
                         uint64_t *token_word, const uint8_t *secret, void **rkey, size_t *rkey_len, char *err) {
    if (slot >= MA_MAX_REGIONS) {
        snprintf(err, MA_ERRLEN, "slot %u out of range", slot);
        return MA_EINVAL;
    }
    ma_region *r = (ma_region *)calloc(1, sizeof(ma_region));
    if (r == NULL) return MA_ENOMEM;
    r->addr = (char *)addr;
    r->len = len;
    r->readonly = readonly;
    r->token = token;
    r->token_word = token_word;
    memcpy(r->secret, secret, 16);
    r->state = R_LIVE;
    *rkey = NULL;
    *rkey_len = 0;
    if (len) {
        ucp_mem_map_params_t mp;
        memset(&mp, 0, sizeof(mp));
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = addr;
        mp.length = len;
        ucs_status_t st = ucp_mem_map(e->ctx, &mp, &r->memh);
        if (st != UCS_OK) {
            free(r);
            ma_err(err, "%s failed: %s", "ucp_mem_map", st);
            return MA_EINVAL;
        }
        st = ucp_rkey_pack(e->ctx, r->memh, rkey, rkey_len);
        if (st != UCS_OK) {
            ucp_mem_unmap(e->ctx, r->memh);
            free(r);
            ma_err(err, "%s failed: %s", "ucp_rkey_pack", st);
            return MA_EINVAL;
        }
    }
    pthread_mutex_lock(&e->qlock);
    ma_region *old = e->regions[slot];
    e->regions[slot] = old == NULL ? r : old;
    pthread_mutex_unlock(&e->qlock);
    if (old != NULL) {
        if (*rkey != NULL) ucp_rkey_buffer_release(*rkey);
        if (r->memh != NULL) ucp_mem_unmap(e->ctx, r->memh);
        free(r);
        snprintf(err, MA_ERRLEN, "slot %u is registered already", slot);
        return MA_EINVAL;
    }
    return MA_OK;
}

typedef struct {
    ma_engine *e;
    ma_region *r;
} region_idle;

static int region_idle_done(void *arg) {
    region_idle *s = (region_idle *)arg;
    pthread_mutex_lock(&s->e->qlock);
    int idle = s->r->inflight == 0;
    pthread_mutex_unlock(&s->e->qlock);
    return idle;
}

/* Drop a block: no new served transfer starts; wait (at most timeout_ns) for those in flight to finish
 * or fail, then unmap. MA_OK when released, MA_ETIMEOUT when transfers are still running (call again). */
static int ma_region_release(ma_engine *e, unsigned slot, int64_t timeout_ns) {
    if (slot >= MA_MAX_REGIONS) return MA_EINVAL;
    pthread_mutex_lock(&e->qlock);
    ma_region *r = e->regions[slot];
    if (r != NULL) {
        r->state = R_DROPPED;
        r->token = 0;
    }
    pthread_mutex_unlock(&e->qlock);
    if (r == NULL) return MA_OK;
    region_idle s = {e, r};
    if (!region_idle_done(&s)) {
        if (LOAD(e->closed)) return MA_OK;
        eng_wait(e, region_idle_done, &s, ma_now() + timeout_ns, 0);
        if (!region_idle_done(&s)) return MA_ETIMEOUT;
    }
    pthread_mutex_lock(&e->qlock);
    e->regions[slot] = NULL;
    pthread_mutex_unlock(&e->qlock);
    if (r->memh != NULL && !LOAD(e->closed)) ucp_mem_unmap(e->ctx, r->memh);
    free(r);
    return MA_OK;
}

/* Map the owner's token table once, for readers that check tokens with RMA. */
static int ma_token_table(ma_engine *e, void *addr, size_t len, void **rkey, size_t *rkey_len, char *err) {
    ucs_status_t st;
    if (e->token_memh == NULL) {
        ucp_mem_map_params_t mp;
        memset(&mp, 0, sizeof(mp));
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = addr;
        mp.length = len;
        st = ucp_mem_map(e->ctx, &mp, &e->token_memh);
        if (st != UCS_OK) {
            e->token_memh = NULL;
            ma_err(err, "%s failed: %s", "ucp_mem_map", st);
            return MA_EINVAL;
        }
    }
    st = ucp_rkey_pack(e->ctx, e->token_memh, rkey, rkey_len);
    if (st != UCS_OK) {
        ma_err(err, "%s failed: %s", "ucp_rkey_pack", st);
        return MA_EINVAL;
    }
    return MA_OK;
}

/* ------------------------------------------------------------------ Buffer transfers (the reader) */
/* Served: a request to the owner's engine, answered by its leader (native: never its Python).
 * op 0 read into local, 1 write from local, 2 drop. MA_OK, MA_DROPPED or an error. */
static int ma_buffer_served(ma_link *l, int op, uint32_t slot, uint64_t token, const uint8_t *secret,
                            uint64_t offset, void *local, size_t n, int64_t timeout_ns, char *err) {
    static const char *whats[] = {"reading a buffer", "writing a buffer", "dropping a buffer"};
    const char *what = whats[op];
    if (link_broken(l) || l->ep == NULL || LOAD(l->fin)) {
        link_reason(l, err, what);
        return MA_ECONN;
    }
    ma_engine *e = l->eng;
    int64_t deadline = ma_now() + timeout_ns;
    unsigned seq = __atomic_fetch_add(&l->seq, 1, __ATOMIC_RELAXED) & 0xffu;
    ma_req_msg m;
    memset(&m, 0, sizeof(m));
    m.magic = MA_MAGIC;
    m.op = (uint8_t)op;
    m.seq = (uint8_t)seq;
    m.slot = slot;
    m.token = token;
    memcpy(m.secret, secret, 16);
    m.offset = offset;
    m.nbytes = n;
    ma_rep_msg rep, rep2;
    ma_op st1, st2, data, req;
    ucp_request_param_t p;
    ma_param_recv(&p, &st1);
    ma_op_start(&st1, ucp_tag_recv_nbx(e->worker, &rep, sizeof(rep), MA_TAG(l->recv_id, seq, K_REPLY), MA_MASK_ALL, &p));
    memset(&st2, 0, sizeof(st2));
    memset(&data, 0, sizeof(data));
    STORE(st2.done, 1);
    STORE(data.done, 1);
    if (op == 1) {
        ma_param_recv(&p, &st2);
        ma_op_start(&st2, ucp_tag_recv_nbx(e->worker, &rep2, sizeof(rep2), MA_TAG(l->recv_id, seq, K_REPLY),
                                           MA_MASK_ALL, &p));
    } else if (op == 0 && n) {
        ma_param_recv(&p, &data);
        ma_op_start(&data, ucp_tag_recv_nbx(e->worker, local, n, MA_TAG(l->recv_id, seq, K_RDATA), MA_MASK_ALL, &p));
    }
    ma_param_send(&p, &req);
    ma_op_start(&req, ucp_tag_send_nbx(l->ep, &m, sizeof(m), MA_TAG(l->send_id, 0, K_REQ), &p));
    int64_t spin = n <= 65536 ? e->spin_ns : 0;
    /* first the owner's answer */
    ma_op *first[3] = {&st1, &req, NULL};
    int rc = link_wait_ops(l, first, 1, deadline, spin, err, what);
    ma_op *all[5] = {&st1, &req, &st2, &data, NULL};
    if (rc != MA_OK) {
        /* (link_wait_ops cancelled or failed what it watched; the other receives go the same way) */
        char tmp[MA_ERRLEN];
        link_wait_ops(l, all, 1 | 4 | 8, ma_now() + 1000, 0, tmp, what);
        goto out;
    }
    if (st1.status != UCS_OK || req.status != UCS_OK || rep.magic != MA_MAGIC) {
        ma_err(err, "%s: %s", what, st1.status != UCS_OK ? st1.status : req.status);
        rc = MA_ECONN;
    } else if (rep.status != 0) {
        rc = MA_DROPPED;
    }
    if (rc != MA_OK) {
        /* nothing more will come: take back our receives */
        if (!ma_op_done(&st2) && st2.req) ucp_request_cancel(e->worker, st2.req);
        if (!ma_op_done(&data) && data.req) ucp_request_cancel(e->worker, data.req);
        ma_op *rest[3] = {&st2, &data, NULL};
        char tmp[MA_ERRLEN];
        link_wait_ops(l, rest, 3, ma_now() + 5000000000LL, 0, tmp, what);
        goto out;
    }
    if (op == 1 && n) {
        ma_op wr;
        ma_param_send(&p, &wr);
        ma_op_start(&wr, ucp_tag_send_nbx(l->ep, local, n, MA_TAG(l->send_id, seq, K_WDATA), &p));
        ma_op *w2[3] = {&wr, &st2, NULL};
        rc = link_wait_ops(l, w2, 2, deadline, 0, err, what);
        if (ma_op_done(&wr)) {
            if (rc == MA_OK && wr.status != UCS_OK) {
                ma_err(err, "%s: %s", what, wr.status);
                rc = MA_ECONN;
            }
            ma_op_release(&wr);
        }
    } else {
        ma_op *rest[3] = {&st2, &data, NULL};
        rc = link_wait_ops(l, rest, 3, deadline, spin, err, what);
    }
    if (rc == MA_OK) {
        if (st2.status != UCS_OK || data.status != UCS_OK) {
            ma_err(err, "%s: %s", what, st2.status != UCS_OK ? st2.status : data.status);
            rc = MA_ECONN;
        } else if (op == 1 && rep2.status != 0) {
            snprintf(err, MA_ERRLEN, "the owner could not receive the written bytes (status %u)", rep2.status);
            rc = MA_ECONN;
        }
    }
out:
    if (ma_op_done(&st1)) ma_op_release(&st1);
    if (ma_op_done(&st2)) ma_op_release(&st2);
    if (ma_op_done(&data)) ma_op_release(&data);
    if (ma_op_done(&req)) ma_op_release(&req);
    return rc;
}

/* One-sided: check the owner's token word, then get/put straight from/to its memory (RMA). */
static int ma_buffer_rma(ma_link *l, int op, uint64_t token, uint64_t token_addr, const void *token_rkey,
                         uint64_t raddr, const void *rkey_buf, void *local, size_t n, int64_t timeout_ns, char *err) {
    static const char *whats[] = {"reading a buffer (rma)", "writing a buffer (rma)", "dropping a buffer (rma)"};
    const char *what = whats[op];
    if (link_broken(l) || l->ep == NULL) {
        link_reason(l, err, what);
        return MA_ECONN;
    }
    ma_engine *e = l->eng;
    int64_t deadline = ma_now() + timeout_ns;
    ucp_rkey_h tk = NULL, rk = NULL;
    ucs_status_t st = ucp_ep_rkey_unpack(l->ep, token_rkey, &tk);
    if (st == UCS_OK && n && op != 2) st = ucp_ep_rkey_unpack(l->ep, rkey_buf, &rk);
    int rc = MA_OK;
    if (st != UCS_OK) {
        ma_err(err, "%s: cannot unpack the remote key: %s", what, st);
        rc = MA_EINVAL;
        goto out;
    }
    uint64_t word = 0;
    ma_op o1, o2;
    ucp_request_param_t p;
    ma_param_send(&p, &o1);
    ma_op_start(&o1, ucp_get_nbx(l->ep, &word, sizeof(word), token_addr, tk, &p));
    ma_op *ops1[2] = {&o1, NULL};
    rc = link_wait_ops(l, ops1, 0, deadline, e->spin_ns, err, what);
    if (ma_op_done(&o1)) ma_op_release(&o1);
    if (rc != MA_OK) goto out;
    if (o1.status != UCS_OK) {
        ma_err(err, "%s: %s", what, o1.status);
        rc = MA_ECONN;
        goto out;
    }
    if (word != token) {
        rc = MA_DROPPED;
        goto out;
    }
    static const uint64_t zero = 0;
    ma_param_send(&p, &o2);
    if (op == 2)
        ma_op_start(&o2, ucp_put_nbx(l->ep, &zero, sizeof(zero), token_addr, tk, &p));
    else if (!n)
        ma_op_start(&o2, NULL);
    else if (op == 0)
        ma_op_start(&o2, ucp_get_nbx(l->ep, local, n, raddr, rk, &p));
    else
        ma_op_start(&o2, ucp_put_nbx(l->ep, local, n, raddr, rk, &p));
    ma_op *ops2[2] = {&o2, NULL};
    rc = link_wait_ops(l, ops2, 0, deadline, n <= 65536 ? e->spin_ns : 0, err, what);
    if (ma_op_done(&o2)) ma_op_release(&o2);
    if (rc == MA_OK && o2.status != UCS_OK) {
        ma_err(err, "%s: %s", what, o2.status);
        rc = MA_ECONN;
    }
    if (rc == MA_OK && op != 0) {
        /* a put is complete at the target only after a flush */
        ma_op f;
        ma_param_send(&p, &f);
        ma_op_start(&f, ucp_ep_flush_nbx(l->ep, &p));
        ma_op *ops3[2] = {&f, NULL};
        rc = link_wait_ops(l, ops3, 0, deadline, 0, err, what);
        if (ma_op_done(&f)) ma_op_release(&f);
        if (rc == MA_OK && f.status != UCS_OK) {
            ma_err(err, "%s: %s", what, f.status);
            rc = MA_ECONN;
        }
    }
out:
    if (tk != NULL) ucp_rkey_destroy(tk);
    if (rk != NULL) ucp_rkey_destroy(rk);
    return rc;
}

/* ------------------------------------------------------------------ the ring's send/receive loop */
typedef struct {
    uint64_t addr, nbytes, flags, src; /* src: what a send reads; a reduce writes src ⊕ received to addr */
} ma_step;

enum { ST_SEND = 1, ST_RECV = 2, ST_REDUCE = 4, ST_FORWARD = 8 };
enum { DT_F32, DT_F64, DT_I8, DT_I16, DT_I32, DT_I64, DT_U8, DT_U16, DT_U32, DT_U64 };
enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX };

/* d[i] = a[i] op s[i] (a may be d; s need not be aligned: a fragment as it lies in UCX's segment) */
#define MA_REDUCE_INT(T, U)                                                                    \
    typedef T T##_una __attribute__((aligned(1)));                                             \
    static void ma_reduce_##T(T *d, const T *a, const T##_una *s, size_t n, int op) {          \
        size_t i;                                                                              \
        switch (op) {                                                                          \
        case OP_SUM: for (i = 0; i < n; i++) d[i] = (T)((U)a[i] + (U)s[i]); break;             \
        case OP_PROD: for (i = 0; i < n; i++) d[i] = (T)((U)a[i] * (U)s[i]); break;            \
        case OP_MIN: for (i = 0; i < n; i++) d[i] = s[i] < a[i] ? s[i] : a[i]; break;          \
        default: for (i = 0; i < n; i++) d[i] = s[i] > a[i] ? s[i] : a[i]; break;              \
        }                                                                                      \
    }
/* floats: min/max propagate NaN as NumPy's minimum/maximum do */
#define MA_REDUCE_FLT(T)                                                                       \
    typedef T T##_una __attribute__((aligned(1)));                                             \
    static void ma_reduce_##T(T *d, const T *a, const T##_una *s, size_t n, int op) {          \
        size_t i;                                                                              \
        switch (op) {                                                                          \
        case OP_SUM: for (i = 0; i < n; i++) d[i] = a[i] + s[i]; break;                        \
        case OP_PROD: for (i = 0; i < n; i++) d[i] = a[i] * s[i]; break;                       \
        case OP_MIN: for (i = 0; i < n; i++) d[i] = (a[i] < s[i] || a[i] != a[i]) ? a[i] : s[i]; break; \
        default: for (i = 0; i < n; i++) d[i] = (a[i] > s[i] || a[i] != a[i]) ? a[i] : s[i]; break;     \
        }                                                                                      \
    }
typedef signed char ma_i8;
typedef short ma_i16;
typedef int32_t ma_i32;
typedef int64_t ma_i64;
typedef unsigned char ma_u8;
typedef unsigned short ma_u16;
typedef uint32_t ma_u32;
typedef uint64_t ma_u64;
MA_REDUCE_FLT(float)
MA_REDUCE_FLT(double)
MA_REDUCE_INT(ma_i8, ma_u8)
MA_REDUCE_INT(ma_i16, ma_u16)
MA_REDUCE_INT(ma_i32, ma_u32)
MA_REDUCE_INT(ma_i64, ma_u64)
MA_REDUCE_INT(ma_u8, ma_u8)
MA_REDUCE_INT(ma_u16, ma_u16)
MA_REDUCE_INT(ma_u32, ma_u32)
MA_REDUCE_INT(ma_u64, ma_u64)

static const size_t MA_DT_SIZE[] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8};

/* d = a op s over nbytes of dtype dt (a may be d) */
static void ma_reduce(int dt, void *d, const void *a, const void *s, size_t nbytes, int op) {
    size_t n = nbytes / MA_DT_SIZE[dt];
    switch (dt) {
    case DT_F32: ma_reduce_float((float *)d, (const float *)a, (const float_una *)s, n, op); break;
    case DT_F64: ma_reduce_double((double *)d, (const double *)a, (const double_una *)s, n, op); break;
    case DT_I8: ma_reduce_ma_i8((ma_i8 *)d, (const ma_i8 *)a, (const ma_i8_una *)s, n, op); break;
    case DT_I16: ma_reduce_ma_i16((ma_i16 *)d, (const ma_i16 *)a, (const ma_i16_una *)s, n, op); break;
    case DT_I32: ma_reduce_ma_i32((ma_i32 *)d, (const ma_i32 *)a, (const ma_i32_una *)s, n, op); break;
    case DT_I64: ma_reduce_ma_i64((ma_i64 *)d, (const ma_i64 *)a, (const ma_i64_una *)s, n, op); break;
    case DT_U8: ma_reduce_ma_u8((ma_u8 *)d, (const ma_u8 *)a, (const ma_u8_una *)s, n, op); break;
    case DT_U16: ma_reduce_ma_u16((ma_u16 *)d, (const ma_u16 *)a, (const ma_u16_una *)s, n, op); break;
    case DT_U32: ma_reduce_ma_u32((ma_u32 *)d, (const ma_u32 *)a, (const ma_u32_una *)s, n, op); break;
    default: ma_reduce_ma_u64((ma_u64 *)d, (const ma_u64 *)a, (const ma_u64_una *)s, n, op); break;
    }
}

#define MA_RING_WINDOW 8

/* A reducing receive unpacks through a generic datatype: UCX hands each fragment, as it lies in its own
 * receive segment, to ring_unpack, which reduces it straight into the step's memory. The fragment is
 * never copied into a scratch chunk first (the kernels read it unaligned). Elements a fragment boundary
 * cuts in two go to the window's scratch chunk at the same offset and are reduced from there when the
 * receive completes. */
typedef struct ring_state ring_state;
typedef struct {
    ring_state *r;
    size_t i;                   /* the step */
    char *tmp;                  /* the window's scratch chunk */
    size_t nedges, cap;
    size_t *edges;              /* elements cut by a fragment boundary (reduced from tmp at the end) */
} ring_unpack;

struct ring_state {
    ma_link *right, *left;
    const ma_step *steps;
    size_t n;
    int dt, op;
    ma_op *sends;       /* one per step (used by the steps that send) */
    ma_op *recvs;       /* one per step (used by the steps that receive) */
    ring_unpack *ups;   /* one per step (used by the reducing receives) */
    size_t *ridx;       /* indices of the receiving steps, in order */
    size_t nrecv, head, posted, nsend, sends_done;
    char *tmp[MA_RING_WINDOW];
    int failed;
    int64_t last;       /* when something last completed */
    ucs_status_t why;
};

static void *ring_dt_start_pack(void *ctx, const void *buf, size_t count) {
    (void)ctx, (void)count;
    return (void *)buf;
}
static void *ring_dt_start_unpack(void *ctx, void *buf, size_t count) {
    (void)ctx, (void)count;
    ring_unpack *u = (ring_unpack *)buf;
    u->nedges = 0;
    return buf;
}
static size_t ring_dt_packed_size(void *state) {
    ring_unpack *u = (ring_unpack *)state;
    return u->r->steps[u->i].nbytes;
}
static size_t ring_dt_pack(void *state, size_t off, void *dest, size_t max) {
    (void)state, (void)off, (void)dest, (void)max;
    return 0; /* (never sent with this datatype) */
}
static void ring_dt_finish(void *state) { (void)state; }

static ucs_status_t ring_dt_unpack(void *state, size_t off, const void *src, size_t len) {
    ring_unpack *u = (ring_unpack *)state;
    const ma_step *s = &u->r->steps[u->i];
    size_t esz = MA_DT_SIZE[u->r->dt], end = off + len;
    if (end > s->nbytes) return UCS_ERR_MESSAGE_TRUNCATED;
    if (len == 0) return UCS_OK;
    char *d = (char *)(uintptr_t)s->addr;
    const char *a = (const char *)(uintptr_t)s->src;
    size_t e0 = (off + esz - 1) / esz, e1 = end / esz; /* the elements wholly inside [off, end) */
    if (e0 < e1)
        ma_reduce(u->r->dt, d + e0 * esz, a + e0 * esz, (const char *)src + (e0 * esz - off), (e1 - e0) * esz,
                  u->r->op);
    if (e0 >= e1 || off % esz || end % esz) {
        /* cut elements: their bytes wait in tmp; the fragment holding an element's first byte lists it */
        size_t first = off / esz, last = (end - 1) / esz;
        for (size_t k = first; k <= last; k++) {
            if (k >= e0 && k < e1) continue;
            size_t lo = k * esz > off ? k * esz : off, hi = (k + 1) * esz < end ? (k + 1) * esz : end;
            memcpy(u->tmp + lo, (const char *)src + (lo - off), hi - lo);
            if (k * esz < off) continue;
            if (u->nedges == u->cap) {
                size_t cap = u->cap ? 2 * u->cap : 16;
                size_t *more = (size_t *)realloc(u->edges, cap * sizeof(size_t));
                if (more == NULL) return UCS_ERR_NO_MEMORY;
                u->edges = more;
                u->cap = cap;
            }
            u->edges[u->nedges++] = k;
        }
    }
    return UCS_OK;
}

static const ucp_generic_dt_ops_t ring_dt_ops = {ring_dt_start_pack, ring_dt_start_unpack, ring_dt_packed_size,
                                                 ring_dt_pack, ring_dt_unpack, ring_dt_finish};
static ucp_datatype_t ring_dt;
static int ring_dt_ok = -1; /* -1 not made yet, 0 failed (a ring that reduces then fails), 1 made */
static pthread_once_t ring_dt_once = PTHREAD_ONCE_INIT;
static void ring_dt_make(void) { ring_dt_ok = ucp_dt_create_generic(&ring_dt_ops, NULL, &ring_dt) == UCS_OK; }

static void ring_post_send(ring_state *r, size_t i) {
    ucp_request_param_t p;
    ma_param_send(&p, &r->sends[i]);
    const ma_step *s = &r->steps[i];
    void *from = (void *)(uintptr_t)((s->flags & ST_SEND) ? s->src : s->addr); /* (a forward sends the result) */
    ma_op_start(&r->sends[i], ucp_tag_send_nbx(r->right->ep, from,
                                               r->steps[i].nbytes, MA_TAG(r->right->send_id, 0, K_RING), &p));
    r->nsend++;
}

static void ring_post_recvs(ring_state *r) {
    while (r->posted < r->nrecv && r->posted - r->head < MA_RING_WINDOW) {
        size_t i = r->ridx[r->posted];
        const ma_step *s = &r->steps[i];
        ucp_request_param_t p;
        ma_param_recv(&p, &r->recvs[i]);
        void *dst = (void *)(uintptr_t)s->addr;
        size_t count = s->nbytes;
        if (s->flags & ST_REDUCE) {
            ring_unpack *u = &r->ups[i];
            u->r = r;
            u->i = i;
            u->tmp = r->tmp[r->posted % MA_RING_WINDOW];
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
            p.datatype = ring_dt;
            dst = u;
            count = 1;
        }
        ma_op_start(&r->recvs[i], ucp_tag_recv_nbx(r->left->eng->worker, dst, count,
                                                   MA_TAG(r->left->recv_id, 0, K_RING), MA_MASK_ALL, &p));
        r->posted++;
    }
}

/* Called after each progress pass: take the receives that completed, in order: reduce, forward, refill. */
static int ring_step(void *arg) {
    ring_state *r = (ring_state *)arg;
    if (r->failed) return 1;
    int moved = 0;
    while (r->head < r->posted) {
        size_t i = r->ridx[r->head];
        if (!ma_op_done(&r->recvs[i])) break;
        const ma_step *s = &r->steps[i];
        if (r->recvs[i].status != UCS_OK) {
            r->failed = 1;
            r->why = r->recvs[i].status;
            return 1;
        }
        if (s->flags & ST_REDUCE) {
            /* the elements cut by fragment boundaries, whole in the scratch chunk by now */
            ring_unpack *u = &r->ups[i];
            size_t esz = MA_DT_SIZE[r->dt];
            for (size_t k = 0; k < u->nedges; k++) {
                size_t o = u->edges[k] * esz;
                ma_reduce(r->dt, (char *)(uintptr_t)s->addr + o, (const char *)(uintptr_t)s->src + o, u->tmp + o,
                          esz, r->op);
            }
        }
        if (s->flags & ST_FORWARD) ring_post_send(r, i);
        r->head++;
        moved = 1;
    }
    if (moved) ring_post_recvs(r);
    size_t done = 0;
    for (size_t i = 0; i < r->n; i++) {
        if (!(r->steps[i].flags & (ST_SEND | ST_FORWARD)) || !ma_op_done(&r->sends[i])) continue;
        if (r->sends[i].status != UCS_OK) {
            r->failed = 1;
            r->why = r->sends[i].status;
            return 1;
        }
        ma_op_release(&r->sends[i]);
        done++;
    }
    if (done != r->sends_done || moved) r->last = ma_now();
    r->sends_done = done;
    if (link_broken(r->left) || link_broken(r->right)) {
        r->failed = 1;
        return 1;
    }
    return r->head == r->nrecv && r->sends_done == r->nsend;
}

/* Run a ring plan: the steps' sends on `right`, receives on `left`, receives in order into each step's
 * memory (or a scratch chunk reduced into it), forwarding what a step says. One thread, no Python. */
static int ma_ring_run(ma_link *right, ma_link *left, const ma_step *steps, size_t n, int dt, int op,
                       size_t chunk, int64_t timeout_ns, char *err) {
    ma_engine *e = left->eng;
    if (link_broken(right) || link_broken(left) || right->ep == NULL) {
        link_reason(link_broken(right) ? right : left, err, "running a ring step");
        return MA_ECONN;
    }
    ring_state r;
    memset(&r, 0, sizeof(r));
    r.right = right;
    r.left = left;
    r.steps = steps;
    r.n = n;
    r.dt = dt;
    r.op = op;
    r.sends = (ma_op *)calloc(n ? n : 1, sizeof(ma_op));
    r.recvs = (ma_op *)calloc(n ? n : 1, sizeof(ma_op));
    r.ridx = (size_t *)calloc(n ? n : 1, sizeof(size_t));
    r.ups = (ring_unpack *)calloc(n ? n : 1, sizeof(ring_unpack));
    int rc = MA_OK;
    pthread_once(&ring_dt_once, ring_dt_make);
    if (r.sends == NULL || r.recvs == NULL || r.ridx == NULL || r.ups == NULL) {
        rc = MA_ENOMEM;
        goto out;
    }
    if (chunk == 0) chunk = 1;
    if (left->scratch_len < MA_RING_WINDOW * chunk) {
        free(left->scratch);
        left->scratch = (char *)malloc(MA_RING_WINDOW * chunk);
        left->scratch_len = left->scratch != NULL ? MA_RING_WINDOW * chunk : 0;
        if (left->scratch == NULL) {
            rc = MA_ENOMEM;
            goto out;
        }
    }
    for (int k = 0; k < MA_RING_WINDOW; k++) r.tmp[k] = left->scratch + (size_t)k * chunk;
    for (size_t i = 0; i < n; i++) {
        if (steps[i].flags & ST_RECV) {
            if ((steps[i].flags & ST_REDUCE) && steps[i].nbytes > chunk) {
                snprintf(err, MA_ERRLEN, "ring step of %llu bytes exceeds the chunk of %zu",
                         (unsigned long long)steps[i].nbytes, chunk);
                rc = MA_EINVAL;
                goto out;
            }
            if ((steps[i].flags & ST_REDUCE) && !ring_dt_ok) {
                snprintf(err, MA_ERRLEN, "ucp_dt_create_generic failed: the ring's reducing datatype");
                rc = MA_ENOMEM;
                goto out;
            }
            if ((steps[i].flags & ST_REDUCE) && steps[i].nbytes % MA_DT_SIZE[dt]) {
                snprintf(err, MA_ERRLEN, "reducing ring step of %llu bytes is not whole elements of %zu bytes",
                         (unsigned long long)steps[i].nbytes, MA_DT_SIZE[dt]);
                rc = MA_EINVAL;
                goto out;
            }
            r.ridx[r.nrecv++] = i;
        }
    }
    ring_post_recvs(&r);
    for (size_t i = 0; i < n; i++)
        if (steps[i].flags & ST_SEND) ring_post_send(&r, i);
    r.last = ma_now();
    for (;;) {
        int w = eng_wait(e, ring_step, &r, r.last + timeout_ns, 0);
        if (r.failed || w != MA_OK) break;
        if (r.head == r.nrecv && r.sends_done == r.nsend) break;
    }
    if (!r.failed && r.head == r.nrecv && r.sends_done == r.nsend) goto out;
    /* failed: take every request back before the memory goes */
    if (r.why != UCS_OK)
        ma_err(err, "%s: %s", "a ring transfer failed", r.why);
    else if (link_broken(left) || link_broken(right))
        link_reason(link_broken(left) ? left : right, err, "running a ring step");
    else
        snprintf(err, MA_ERRLEN, "no progress for %.0f s in a ring step", (double)timeout_ns / 1e9);
    rc = MA_ECONN;
    for (size_t k = r.head; k < r.posted; k++) {
        size_t i = r.ridx[k];
        if (!ma_op_done(&r.recvs[i]) && r.recvs[i].req != NULL) ucp_request_cancel(e->worker, r.recvs[i].req);
    }
    if (LOAD(right->error) == 0) STORE(right->error, (int)UCS_ERR_CANCELED);
    link_force_close(e, right);
    eng_kick(e);
    {
        ma_op **all = (ma_op **)calloc(2 * n + 1, sizeof(ma_op *));
        if (all != NULL) {
            size_t k = 0;
            for (size_t i = 0; i < n; i++) {
                if ((steps[i].flags & (ST_SEND | ST_FORWARD)) && (r.sends[i].req != NULL)) all[k++] = &r.sends[i];
                if ((steps[i].flags & ST_RECV) && r.recvs[i].req != NULL) all[k++] = &r.recvs[i];
            }
            ops_drain(e, all);
            free(all);
        }
    }
out:
    if (r.sends != NULL && r.recvs != NULL)
        for (size_t i = 0; i < n; i++) {
            if (ma_op_done(&r.sends[i])) ma_op_release(&r.sends[i]);
            if (ma_op_done(&r.recvs[i])) ma_op_release(&r.recvs[i]);
        }
    free(r.sends);
    free(r.recvs);
    free(r.ridx);
    if (r.ups != NULL)
        for (size_t i = 0; i < n; i++) free(r.ups[i].edges);
    free(r.ups);
    return rc;
}

#endif
