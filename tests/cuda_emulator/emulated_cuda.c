/*
 * An emulated CUDA driver: a test double of libcuda.so.1's ABI for CI machines
 * without a GPU. Part of asyncfence's test suite; never shipped.
 *
 * cuda.bindings resolves every entry point through cuGetProcAddress_v2, so this
 * library exports that resolver plus the entry points asyncfence uses. It
 * models what the fence logic depends on, not a GPU:
 *   - each stream is a thread that runs its queue of operations in order;
 *   - events complete when their stream reaches them; a context fault is
 *     sticky: queries return it, queued work is dropped, host functions never
 *     run again (as the real driver documents for cuLaunchHostFunc);
 *   - cuStreamWaitValue32 / cuStreamWriteValue32 act on host memory;
 *   - "device" memory is host memory, so memsets are real work on the stream
 *     (on registered host memory too: cuMemHostRegister checks its arguments);
 *   - handle 0 and 1 are the legacy default stream and 2 the calling thread's
 *     per-thread default stream (0 too, once cuda.bindings resolved its entry
 *     points for per-thread default streams: CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM);
 *   - stream capture (cuStreamBeginCapture ... cuStreamEndCapture): work on a
 *     capturing stream is not executed, events recorded there are captured
 *     (CUDA_ERROR_CAPTURED_EVENT on query), a stream that waits for a captured
 *     event joins the capture (EndCapture fails with UNJOINED unless it is
 *     joined back), the legacy stream refuses work while a blocking stream of
 *     its context captures (STREAM_CAPTURE_IMPLICIT), and "unsafe" calls
 *     (queries, synchronizations, cuMemAlloc) are refused and invalidate the
 *     capture as the capture modes say; graphs replay their captured memsets.
 *   - interprocess events (CU_EVENT_INTERPROCESS, cuIpcGetEventHandle,
 *     cuIpcOpenEventHandle) keep their record and completion counts in a
 *     memfd that the importing process maps (through /proc/PID/fd: the same
 *     user only, as the real driver's IPC); a wait on an opened event polls
 *     them, and the exporter's context fault never completes them;
 * Test hooks (emu_*) hold and release streams, inject faults and count live
 * objects. Handles are validated against registries, so a stale or bogus
 * handle gives CUDA_ERROR_INVALID_HANDLE instead of a crash.
 *
 * Built with -DASYNCFENCE_WITH_CUDA_H and the toolkit's include folder (as
 * build() does where CUDA 13.0's or a newer cuda.h is present), it compiles
 * against the real cuda.h and cudaTypedefs.h, so a drift from them is a build
 * error: every exported function's definition must match its cuda.h
 * prototype, the typedefs below must repeat cuda.h's, every row of
 * entry_points[] must match its PFN_<name>_v<version> type (and every other
 * PFN type a caller may call it through), and every constant must equal
 * cuda.h's. Without the header it builds alone, with the same typedefs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef ASYNCFENCE_WITH_CUDA_H
/* As the driver's own build: cuda.h then declares every exported name as it is
 * (cuStreamDestroy, not a macro for cuStreamDestroy_v2; the legacy v1 forms, the
 * _ptsz ones) and cudaTypedefs.h every PFN type, the older ones included. */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#include <cudaTypedefs.h>
#if CUDA_VERSION < 13000
#error "the emulator models CUDA 13.0's API: it needs cuda.h of CUDA 13.0 or newer"
#endif
#else
/* cuda.h's enums, complete types as there (the values the emulator uses are
 * its own constants below), and the tags it points to. */
enum cudaError_enum { CUDA_SUCCESS = 0 };
enum CUdevice_attribute_enum { CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1 };
enum CUstreamCaptureMode_enum { CU_STREAM_CAPTURE_MODE_GLOBAL = 0 };
enum CUstreamCaptureStatus_enum { CU_STREAM_CAPTURE_STATUS_NONE = 0 };
enum CUdriverProcAddressQueryResult_enum { CU_GET_PROC_ADDRESS_SUCCESS = 0 };
struct CUgraphEdgeData_st;
#endif

/* cuda.h's types (C11 lets a typedef be repeated for the same type: with the
 * header, each of these must be cuda.h's own, or the build fails). */
typedef enum cudaError_enum CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef enum CUdevice_attribute_enum CUdevice_attribute;
typedef enum CUstreamCaptureMode_enum CUstreamCaptureMode;
typedef enum CUstreamCaptureStatus_enum CUstreamCaptureStatus;
typedef enum CUdriverProcAddressQueryResult_enum CUdriverProcAddressQueryResult;
typedef struct CUctx_st *CUcontext;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;
typedef void (*CUhostFn)(void *);
#define IPC_HANDLE_SIZE 64
#ifndef ASYNCFENCE_WITH_CUDA_H
typedef struct CUipcEventHandle_st { char reserved[IPC_HANDLE_SIZE]; } CUipcEventHandle_v1;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
#endif
typedef struct CUipcEventHandle_st CUipcEventHandle;

/* The CUresult codes (plain ints: they convert to cuda.h's enums without a warning). */
#define SUCCESS 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_INITIALIZED 3
#define NO_DEVICE 100
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define INVALID_HANDLE 400
#define ILLEGAL_STATE 401
#define MAP_FAILED_CODE 205
#define NOT_REGISTERED 713
#define NOT_FOUND 500
#define NOT_READY 600
#define ILLEGAL_ADDRESS 700
#define LAUNCH_FAILED 719
#define NOT_PERMITTED 800
#define NOT_SUPPORTED 801
#define STREAM_CAPTURE_UNSUPPORTED 900
#define STREAM_CAPTURE_INVALIDATED 901
#define STREAM_CAPTURE_UNMATCHED 903
#define STREAM_CAPTURE_UNJOINED 904
#define STREAM_CAPTURE_ISOLATION 905
#define STREAM_CAPTURE_IMPLICIT 906
#define CAPTURED_EVENT 907
#define STREAM_CAPTURE_WRONG_THREAD 908

/* CUstreamCaptureMode, CUstreamCaptureStatus, CU_STREAM_NON_BLOCKING */
#define MODE_GLOBAL 0
#define MODE_THREAD_LOCAL 1
#define MODE_RELAXED 2
#define CAPTURE_NONE 0
#define CAPTURE_ACTIVE 1
#define CAPTURE_INVALIDATED 2
#define STREAM_NON_BLOCKING 1
/* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM; CUdriverProcAddressQueryResult */
#define PROC_PER_THREAD_DEFAULT_STREAM 2
#define PROC_FOUND 0
#define PROC_SYMBOL_NOT_FOUND 1
#define PROC_VERSION_NOT_SUFFICIENT 2
/* CUevent_flags: CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS */
#define EVENT_BLOCKING_SYNC 1
#define EVENT_DISABLE_TIMING 2
#define EVENT_INTERPROCESS 4
#define EVENT_FLAGS (EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS)
/* CUstreamWaitValue_flags: the comparisons cuStreamWaitValue32 knows */
enum { WAIT_VALUE_GEQ = 0, WAIT_VALUE_EQ = 1, WAIT_VALUE_AND = 2, WAIT_VALUE_NOR = 3 };

#ifdef ASYNCFENCE_WITH_CUDA_H
/* Every constant is cuda.h's. */
#define SAME_AS_CUDA_H(ours, theirs) \
    _Static_assert((long long)(ours) == (long long)(theirs), #ours " differs from " #theirs " of cuda.h");
SAME_AS_CUDA_H(SUCCESS, CUDA_SUCCESS)
SAME_AS_CUDA_H(INVALID_VALUE, CUDA_ERROR_INVALID_VALUE)
SAME_AS_CUDA_H(OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY)
SAME_AS_CUDA_H(NOT_INITIALIZED, CUDA_ERROR_NOT_INITIALIZED)
SAME_AS_CUDA_H(NO_DEVICE, CUDA_ERROR_NO_DEVICE)
SAME_AS_CUDA_H(INVALID_DEVICE, CUDA_ERROR_INVALID_DEVICE)
SAME_AS_CUDA_H(INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT)
SAME_AS_CUDA_H(INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE)
SAME_AS_CUDA_H(ILLEGAL_STATE, CUDA_ERROR_ILLEGAL_STATE)
SAME_AS_CUDA_H(NOT_FOUND, CUDA_ERROR_NOT_FOUND)
SAME_AS_CUDA_H(NOT_REGISTERED, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
SAME_AS_CUDA_H(MAP_FAILED_CODE, CUDA_ERROR_MAP_FAILED)
SAME_AS_CUDA_H(IPC_HANDLE_SIZE, CU_IPC_HANDLE_SIZE)
SAME_AS_CUDA_H(NOT_READY, CUDA_ERROR_NOT_READY)
SAME_AS_CUDA_H(ILLEGAL_ADDRESS, CUDA_ERROR_ILLEGAL_ADDRESS)
SAME_AS_CUDA_H(LAUNCH_FAILED, CUDA_ERROR_LAUNCH_FAILED)
SAME_AS_CUDA_H(NOT_PERMITTED, CUDA_ERROR_NOT_PERMITTED)
SAME_AS_CUDA_H(NOT_SUPPORTED, CUDA_ERROR_NOT_SUPPORTED)
SAME_AS_CUDA_H(STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
SAME_AS_CUDA_H(STREAM_CAPTURE_INVALIDATED, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
SAME_AS_CUDA_H(STREAM_CAPTURE_UNMATCHED, CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
SAME_AS_CUDA_H(STREAM_CAPTURE_UNJOINED, CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
SAME_AS_CUDA_H(STREAM_CAPTURE_ISOLATION, CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
SAME_AS_CUDA_H(STREAM_CAPTURE_IMPLICIT, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
SAME_AS_CUDA_H(CAPTURED_EVENT, CUDA_ERROR_CAPTURED_EVENT)
SAME_AS_CUDA_H(STREAM_CAPTURE_WRONG_THREAD, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
SAME_AS_CUDA_H(MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_GLOBAL)
SAME_AS_CUDA_H(MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
SAME_AS_CUDA_H(MODE_RELAXED, CU_STREAM_CAPTURE_MODE_RELAXED)
SAME_AS_CUDA_H(CAPTURE_NONE, CU_STREAM_CAPTURE_STATUS_NONE)
SAME_AS_CUDA_H(CAPTURE_ACTIVE, CU_STREAM_CAPTURE_STATUS_ACTIVE)
SAME_AS_CUDA_H(CAPTURE_INVALIDATED, CU_STREAM_CAPTURE_STATUS_INVALIDATED)
SAME_AS_CUDA_H(STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING)
SAME_AS_CUDA_H(PROC_PER_THREAD_DEFAULT_STREAM, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
SAME_AS_CUDA_H(PROC_FOUND, CU_GET_PROC_ADDRESS_SUCCESS)
SAME_AS_CUDA_H(PROC_SYMBOL_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
SAME_AS_CUDA_H(PROC_VERSION_NOT_SUFFICIENT, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
SAME_AS_CUDA_H(EVENT_BLOCKING_SYNC, CU_EVENT_BLOCKING_SYNC)
SAME_AS_CUDA_H(EVENT_DISABLE_TIMING, CU_EVENT_DISABLE_TIMING)
SAME_AS_CUDA_H(EVENT_INTERPROCESS, CU_EVENT_INTERPROCESS)
SAME_AS_CUDA_H(WAIT_VALUE_GEQ, CU_STREAM_WAIT_VALUE_GEQ)
SAME_AS_CUDA_H(WAIT_VALUE_EQ, CU_STREAM_WAIT_VALUE_EQ)
SAME_AS_CUDA_H(WAIT_VALUE_AND, CU_STREAM_WAIT_VALUE_AND)
SAME_AS_CUDA_H(WAIT_VALUE_NOR, CU_STREAM_WAIT_VALUE_NOR)
#undef SAME_AS_CUDA_H
#endif

#define MAX_DEVICES 8
/* The version reported by default; ASYNCFENCE_EMULATED_DRIVER_VERSION (13000 for
 * CUDA 13.0, say) models an older driver: cuGetProcAddress then refuses newer
 * versions and never hands out entry points that came after it. */
#define DEFAULT_DRIVER_VERSION 13020

/* The handles' structs are cuda.h's opaque ones (a CUstream is a stream_t *). */
typedef struct CUstream_st stream_t;
typedef struct capture capture_t;

typedef struct CUctx_st {
    int device;
    int sticky; /* 0, or the sticky error code */
    stream_t *default_stream; /* the legacy default stream */
    unsigned long long id; /* cuCtxGetId's: new at every creation and reset */
} context_t;

typedef struct CUevent_st {
    context_t *ctx;
    unsigned flags;
    uint64_t target; /* generation of the latest record */
    uint64_t done;   /* highest generation the stream has passed */
    uint64_t stamp_ns; /* when the stream passed it, for timing events */
    int refs;        /* the user's handle plus queued operations */
    /* Last recorded in a capturing stream: never completes (CAPTURED_EVENT). */
    int captured;
    uint64_t capture_id;      /* the capture it was recorded in */
    stream_t *capture_stream; /* compared, never dereferenced once the capture ended */
    uint64_t capture_ops;     /* that stream's captured-operation count at the record */
    /* Interprocess: the counts live in shared memory (see ipc_counts_t). */
    struct ipc_counts *shared;
    int shared_fd; /* the exporter's memfd; -1 in an importer and for local events */
    int opened;    /* opened from another process's handle (cuIpcOpenEventHandle) */
} event_t;
/* An interprocess event's counts, shared by the exporting and importing processes. */
typedef struct ipc_counts {
    char magic[8];   /* IPC_MAGIC: what cuIpcOpenEventHandle checks it mapped */
    uint64_t target; /* generation of the latest record (in the exporter) */
    uint64_t done;   /* highest generation the exporter's stream has passed */
} ipc_counts_t;
/* What an emulated CUipcEventHandle holds. */
typedef struct { char magic[8]; int32_t pid; int32_t fd; } ipc_handle_t;
static const char IPC_MAGIC[8] = {'a', 'f', 'e', 'm', 'u', 'i', 'p', 'c'};

typedef struct gate { int open; int refs; } gate_t;

enum op_kind { OP_RECORD, OP_WAIT_EVENT, OP_HOST_FUNC, OP_WAIT_VALUE, OP_WRITE_VALUE,
               OP_GATE, OP_FAULT, OP_MEMSET, OP_FREE };

typedef struct op {
    enum op_kind kind;
    struct op *next;
    event_t *event;
    uint64_t generation;
    CUhostFn fn;
    void *data;
    volatile uint32_t *address;
    uint32_t value;
    unsigned flags;
    gate_t *gate;
    int code;
    size_t bytes;
} op_t;

struct CUstream_st {
    context_t *ctx;
    op_t *head, *tail;
    int busy;
    int destroyed;
    unsigned flags;
    int per_thread;       /* a per-thread default stream */
    capture_t *capture;   /* the capture it takes part in, or NULL */
    uint64_t capture_ops; /* operations captured from it so far */
    int joined;           /* its captured work is joined back into the capture */
    pthread_cond_t wake;
};

/* An ongoing capture sequence: its origin stream, the streams it pulled in,
 * and the memsets captured so far (all a graph of this emulator replays). */
struct capture {
    uint64_t id;
    int mode;
    pthread_t thread;
    int invalidated;
    stream_t *origin;
    stream_t **members;
    size_t n_members, cap_members;
    op_t *head, *tail;
    capture_t *next;
};

/* What cuStreamEndCapture returns, and its instantiations: the captured memsets. */
typedef struct CUgraph_st { op_t *head; } graph_t;
typedef struct CUgraphExec_st { op_t *head; } graph_exec_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static int initialized;
static int device_count = 2;
static context_t *primary[MAX_DEVICES];
static long live_events, live_streams, pending_host_funcs, events_created, live_host_allocs;
static long host_funcs_v1, host_funcs_v2, live_host_registrations;
static unsigned long long next_context_id = 1;
static void *last_host_fn;

static int driver_version(void) {
    static int version;
    if (!version) {
        const char *env = getenv("ASYNCFENCE_EMULATED_DRIVER_VERSION");
        int parsed = env ? atoi(env) : 0;
        version = parsed > 0 ? parsed : DEFAULT_DRIVER_VERSION;
    }
    return version;
}

static __thread context_t *ctx_stack[32];
static __thread int ctx_depth;

/* ---- handle registry: a set of live pointers, so bad handles are errors ---- */

typedef struct { void **slots; size_t cap, used; } ptrset_t;
#define TOMBSTONE ((void *)1)

static size_t hash_ptr(void *p, size_t cap) {
    uintptr_t x = (uintptr_t)p;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;
    return x & (cap - 1);
}

static void ptrset_add(ptrset_t *s, void *p);

static void ptrset_grow(ptrset_t *s) {
    ptrset_t bigger = { calloc(s->cap ? s->cap * 2 : 1024, sizeof(void *)), s->cap ? s->cap * 2 : 1024, 0 };
    for (size_t i = 0; i < s->cap; i++)
        if (s->slots[i] && s->slots[i] != TOMBSTONE) ptrset_add(&bigger, s->slots[i]);
    free(s->slots);
    *s = bigger;
}

static void ptrset_add(ptrset_t *s, void *p) {
    if ((s->used + 1) * 2 > s->cap) ptrset_grow(s);
    size_t i = hash_ptr(p, s->cap);
    while (s->slots[i] && s->slots[i] != TOMBSTONE) i = (i + 1) & (s->cap - 1);
    s->slots[i] = p;
    s->used++;
}

static size_t ptrset_find(ptrset_t *s, void *p) {
    if (!s->cap || !p) return (size_t)-1;
    size_t i = hash_ptr(p, s->cap);
    while (s->slots[i]) {
        if (s->slots[i] == p) return i;
        i = (i + 1) & (s->cap - 1);
    }
    return (size_t)-1;
}

static int ptrset_remove(ptrset_t *s, void *p) {
    size_t i = ptrset_find(s, p);
    if (i == (size_t)-1) return 0;
    s->slots[i] = TOMBSTONE; /* used stays counted until the next grow */
    return 1;
}

static ptrset_t live_stream_set, live_event_set, live_context_set;
static ptrset_t per_thread_stream_set, graph_set, graph_exec_set;

/* ---- capture state ------------------------------------------------------------ */

static capture_t *captures; /* ongoing capture sequences */
static uint64_t next_capture_id = 1;
static int per_thread_mode; /* entry points were resolved for per-thread default streams */
static __thread int thread_capture_mode = MODE_GLOBAL; /* cuThreadExchangeStreamCaptureMode */

/* ---- helpers ---------------------------------------------------------------- */

static context_t *current_ctx(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

static void *stream_worker(void *arg);

static stream_t *new_stream_locked(context_t *ctx) {
    stream_t *s = calloc(1, sizeof *s);
    s->ctx = ctx;
    pthread_cond_init(&s->wake, NULL);
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    if (pthread_create(&thread, &attr, stream_worker, s) != 0) {
        free(s);
        return NULL;
    }
    pthread_attr_destroy(&attr);
    return s;
}

static stream_t *per_thread_stream_locked(context_t *ctx);

/* Resolve a stream handle. 0 and 1 are the current context's legacy default
 * stream, 2 the calling thread's per-thread default stream of that context
 * (and 0 as well in per-thread mode, as the _ptsz entry points treat it). */
static CUresult resolve_stream(void *handle, stream_t **out) {
    if (!initialized) return NOT_INITIALIZED;
    uintptr_t h = (uintptr_t)handle;
    if (h <= 2) {
        context_t *ctx = current_ctx();
        if (!ctx) return INVALID_CONTEXT;
        if (h == 2 || (h == 0 && per_thread_mode)) {
            *out = per_thread_stream_locked(ctx);
            return *out ? SUCCESS : OUT_OF_MEMORY;
        }
        if (!ctx->default_stream) ctx->default_stream = new_stream_locked(ctx);
        if (!ctx->default_stream) return OUT_OF_MEMORY;
        *out = ctx->default_stream;
        return SUCCESS;
    }
    if (ptrset_find(&live_stream_set, handle) == (size_t)-1) return INVALID_HANDLE;
    *out = handle;
    return SUCCESS;
}

static CUresult resolve_event(void *handle, event_t **out) {
    if (!initialized) return NOT_INITIALIZED;
    if (ptrset_find(&live_event_set, handle) == (size_t)-1) return INVALID_HANDLE;
    *out = handle;
    return SUCCESS;
}

static void enqueue_locked(stream_t *s, op_t *op) {
    op->next = NULL;
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    pthread_cond_signal(&s->wake);
}

static op_t *new_op(enum op_kind kind) {
    op_t *op = calloc(1, sizeof *op);
    op->kind = kind;
    return op;
}

static void event_unref_locked(event_t *e) {
    if (--e->refs) return;
    if (e->shared) munmap(e->shared, sizeof *e->shared);
    if (e->shared_fd >= 0) close(e->shared_fd);
    free(e);
}

/* An event's record and completion counts: its own, or the shared ones. */
static uint64_t event_target(event_t *e) {
    return e->shared ? __atomic_load_n(&e->shared->target, __ATOMIC_ACQUIRE) : e->target;
}
static uint64_t event_done(event_t *e) {
    return e->shared ? __atomic_load_n(&e->shared->done, __ATOMIC_ACQUIRE) : e->done;
}
static int event_complete(event_t *e) { return event_done(e) >= event_target(e); }

static void gate_unref_locked(gate_t *g) {
    if (--g->refs == 0) free(g);
}

static void drop_op_locked(op_t *op) {
    switch (op->kind) {
    case OP_RECORD: case OP_WAIT_EVENT: event_unref_locked(op->event); break;
    case OP_GATE: gate_unref_locked(op->gate); break;
    default: break;
    }
    free(op);
}

static void free_ops_locked(op_t *op) {
    while (op) {
        op_t *next = op->next;
        drop_op_locked(op);
        op = next;
    }
}

/* ---- per-thread default streams ------------------------------------------------ */

typedef struct { stream_t *streams[MAX_DEVICES]; } per_thread_t;
static __thread per_thread_t *per_thread_streams;
static pthread_key_t per_thread_key;
static pthread_once_t per_thread_once = PTHREAD_ONCE_INIT;

static void stream_leave_capture_locked(stream_t *s);

/* At thread exit: the thread's per-thread default streams drain, then go. */
static void per_thread_release(void *arg) {
    per_thread_t *table = arg;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_DEVICES; i++) {
        stream_t *s = table->streams[i];
        if (!s) continue;
        stream_leave_capture_locked(s);
        ptrset_remove(&per_thread_stream_set, s);
        s->destroyed = 1;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&mu);
    free(table);
}

static void per_thread_key_init(void) { pthread_key_create(&per_thread_key, per_thread_release); }

static stream_t *per_thread_stream_locked(context_t *ctx) {
    if (!per_thread_streams) {
        pthread_once(&per_thread_once, per_thread_key_init);
        per_thread_streams = calloc(1, sizeof *per_thread_streams);
        pthread_setspecific(per_thread_key, per_thread_streams);
    }
    stream_t **slot = &per_thread_streams->streams[ctx->device];
    if (!*slot) {
        *slot = new_stream_locked(ctx);
        if (*slot) {
            (*slot)->per_thread = 1;
            ptrset_add(&per_thread_stream_set, *slot);
        }
    }
    return *slot;
}

/* ---- stream capture ------------------------------------------------------------ */

static capture_t *find_capture_locked(uint64_t id) {
    for (capture_t *c = captures; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static void capture_add_member_locked(capture_t *c, stream_t *s) {
    if (c->n_members == c->cap_members) {
        c->cap_members = c->cap_members ? c->cap_members * 2 : 4;
        c->members = realloc(c->members, c->cap_members * sizeof *c->members);
    }
    c->members[c->n_members++] = s;
    s->capture = c;
    s->capture_ops = 0;
    s->joined = 0;
}

/* Every stream leaves capture mode; the capture is freed, its memsets
 * handed to the caller (a graph) or dropped. */
static op_t *end_capture_locked(capture_t *c) {
    for (size_t i = 0; i < c->n_members; i++) {
        c->members[i]->capture = NULL;
        c->members[i]->capture_ops = 0;
        c->members[i]->joined = 0;
    }
    for (capture_t **link = &captures; *link; link = &(*link)->next)
        if (*link == c) { *link = c->next; break; }
    op_t *ops = c->head;
    free(c->members);
    free(c);
    return ops;
}

/* A destroyed or exiting stream: the capture it was the origin of ends, one it
 * was pulled into is invalidated (it can never be joined back). */
static void stream_leave_capture_locked(stream_t *s) {
    capture_t *c = s->capture;
    if (!c) return;
    if (c->origin == s) {
        free_ops_locked(end_capture_locked(c));
        return;
    }
    for (size_t i = 0; i < c->n_members; i++)
        if (c->members[i] == s) { c->members[i] = c->members[--c->n_members]; break; }
    s->capture = NULL;
    c->invalidated = 1;
}

static int stream_is_blocking(stream_t *s) { return s->per_thread || !(s->flags & STREAM_NON_BLOCKING); }

static int is_legacy_stream(stream_t *s) { return s == s->ctx->default_stream; }

/* The legacy stream synchronizes with every blocking stream of its context:
 * while one of them captures, using it would make it depend on the capture. */
static int legacy_implicit_locked(stream_t *s, int invalidate) {
    if (!is_legacy_stream(s)) return 0;
    int found = 0;
    for (capture_t *c = captures; c; c = c->next) {
        for (size_t i = 0; i < c->n_members; i++) {
            if (c->members[i]->ctx == s->ctx && stream_is_blocking(c->members[i])) {
                found = 1;
                if (invalidate) c->invalidated = 1;
                break;
            }
        }
    }
    return found;
}

/* "Potentially unsafe" calls (queries, synchronizations, cuMemAlloc) are refused
 * on a thread whose capture mode prohibits them, and invalidate the capture
 * sequences that prohibit them: in GLOBAL mode any GLOBAL capture of another
 * thread, in GLOBAL or THREAD_LOCAL mode the thread's own non-RELAXED capture. */
static CUresult unsafe_call_locked(void) {
    if (thread_capture_mode == MODE_RELAXED) return SUCCESS;
    pthread_t self = pthread_self();
    CUresult r = SUCCESS;
    for (capture_t *c = captures; c; c = c->next) {
        int own = pthread_equal(c->thread, self);
        if ((own && c->mode != MODE_RELAXED) ||
            (!own && thread_capture_mode == MODE_GLOBAL && c->mode == MODE_GLOBAL)) {
            c->invalidated = 1;
            r = STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return r;
}

/* Queue an operation: on a capturing stream it is captured instead (memsets
 * kept for graph replay, the rest dropped) and *captured is set. */
static CUresult submit_locked(stream_t *s, op_t *op, int *captured) {
    if (captured) *captured = 0;
    capture_t *c = s->capture;
    if (c) {
        if (c->invalidated) { drop_op_locked(op); return STREAM_CAPTURE_INVALIDATED; }
        s->capture_ops++;
        if (s != c->origin) s->joined = 0;
        if (captured) *captured = 1;
        if (op->kind == OP_MEMSET) {
            op->next = NULL;
            if (c->tail) c->tail->next = op; else c->head = op;
            c->tail = op;
        } else {
            drop_op_locked(op);
        }
        return SUCCESS;
    }
    if (legacy_implicit_locked(s, 1)) { drop_op_locked(op); return STREAM_CAPTURE_IMPLICIT; }
    enqueue_locked(s, op);
    return SUCCESS;
}

static void sleep_ns(long ns) {
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    nanosleep(&ts, NULL);
}

static int value_condition_met(volatile uint32_t *address, uint32_t value, unsigned flags) {
    uint32_t current = __atomic_load_n(address, __ATOMIC_ACQUIRE);
    switch (flags & 0xf) {
    case WAIT_VALUE_GEQ: return (int32_t)(current - value) >= 0; /* cyclic */
    case WAIT_VALUE_EQ: return current == value;
    case WAIT_VALUE_AND: return (current & value) != 0;
    case WAIT_VALUE_NOR: return ~(current | value) != 0;
    default: return 1;
    }
}

/* ---- the stream thread ------------------------------------------------------ */

static void *stream_worker(void *arg) {
    stream_t *s = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!s->head && !s->destroyed) pthread_cond_wait(&s->wake, &mu);
        if (!s->head) break; /* destroyed and drained */
        op_t *op = s->head;
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        int faulted = s->ctx->sticky != 0;
        switch (op->kind) {
        case OP_RECORD:
            if (!faulted && event_done(op->event) < op->generation) {
                struct timespec now;
                clock_gettime(CLOCK_MONOTONIC, &now);
                op->event->stamp_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
                op->event->done = op->generation;
                if (op->event->shared)
                    __atomic_store_n(&op->event->shared->done, op->generation, __ATOMIC_RELEASE);
            }
            event_unref_locked(op->event);
            break;
        case OP_WAIT_EVENT:
            if (op->event->opened) {
                /* Another process's stream completes it: nothing here signals. */
                long backoff = 1000;
                while (event_done(op->event) < op->generation && !s->ctx->sticky) {
                    pthread_mutex_unlock(&mu);
                    sleep_ns(backoff);
                    if (backoff < 200000) backoff *= 2;
                    pthread_mutex_lock(&mu);
                }
            }
            while (op->event->done < op->generation && !op->event->opened && !s->ctx->sticky &&
                   !op->event->ctx->sticky)
                pthread_cond_wait(&progress, &mu);
            event_unref_locked(op->event);
            break;
        case OP_HOST_FUNC:
            if (!faulted) { /* never called after a context fault */
                pthread_mutex_unlock(&mu);
                op->fn(op->data);
                pthread_mutex_lock(&mu);
            }
            pending_host_funcs--;
            break;
        case OP_WAIT_VALUE: {
            long backoff = 1000;
            while (!s->ctx->sticky && !value_condition_met(op->address, op->value, op->flags)) {
                pthread_mutex_unlock(&mu);
                sleep_ns(backoff);
                if (backoff < 500000) backoff *= 2;
                pthread_mutex_lock(&mu);
            }
            break;
        }
        case OP_WRITE_VALUE:
            if (!faulted) __atomic_store_n(op->address, op->value, __ATOMIC_RELEASE);
            break;
        case OP_GATE:
            while (!op->gate->open && !s->ctx->sticky) pthread_cond_wait(&progress, &mu);
            gate_unref_locked(op->gate);
            break;
        case OP_FAULT:
            if (!s->ctx->sticky) s->ctx->sticky = op->code;
            break;
        case OP_MEMSET:
            if (!faulted) {
                pthread_mutex_unlock(&mu);
                memset((void *)op->address, (int)op->value, op->bytes);
                pthread_mutex_lock(&mu);
            }
            break;
        case OP_FREE:
            free((void *)op->address);
            break;
        }
        free(op);
        s->busy = 0;
        pthread_cond_broadcast(&progress);
    }
    pthread_cond_destroy(&s->wake);
    free(s);
    pthread_mutex_unlock(&mu);
    return NULL;
}

/* ---- initialisation, devices, contexts -------------------------------------- */

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!initialized) {
        const char *env = getenv("ASYNCFENCE_EMULATED_DEVICES");
        if (env) {
            int n = atoi(env);
            device_count = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
        }
        initialized = 1;
    }
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return INVALID_VALUE;
    *version = driver_version();
    return SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return NOT_INITIALIZED;
    if (!count) return INVALID_VALUE;
    *count = device_count;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (!device) return INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char *name, int length, CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return INVALID_DEVICE;
    if (!name || length <= 0) return INVALID_VALUE;
    snprintf(name, (size_t)length, "asyncfence emulated device %d", device);
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return INVALID_DEVICE;
    if (!value) return INVALID_VALUE;
    (void)attribute;
    *value = 1; /* every capability asked about (memory pools, mapped host memory, ...) */
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    if (!primary[device]) {
        primary[device] = calloc(1, sizeof(context_t));
        primary[device]->device = device;
        primary[device]->id = next_context_id++;
        ptrset_add(&live_context_set, primary[device]);
    }
    *pctx = primary[device];
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    return device < 0 || device >= device_count ? INVALID_DEVICE : SUCCESS;
}

static CUresult check_context(void *ctx) {
    if (!initialized) return NOT_INITIALIZED;
    return ptrset_find(&live_context_set, ctx) == (size_t)-1 ? INVALID_CONTEXT : SUCCESS;
}

static void stream_leave_capture_locked(stream_t *s);
static void event_unref_locked(event_t *e);

/* Destroy every live event and stream whose context is ctx (their handles turn
 * invalid); the worker of each stream drains its queue, then frees it. */
static void destroy_context_objects_locked(context_t *ctx) {
    for (size_t i = 0; i < live_event_set.cap; i++) {
        event_t *e = live_event_set.slots[i];
        if (!e || (void *)e == TOMBSTONE || e->ctx != ctx) continue;
        live_event_set.slots[i] = TOMBSTONE;
        live_events--;
        event_unref_locked(e);
    }
    for (size_t i = 0; i < live_stream_set.cap; i++) {
        stream_t *st = live_stream_set.slots[i];
        if (!st || (void *)st == TOMBSTONE || st->ctx != ctx) continue;
        live_stream_set.slots[i] = TOMBSTONE;
        stream_leave_capture_locked(st);
        st->destroyed = 1;
        live_streams--;
        pthread_cond_signal(&st->wake);
    }
}

/* As the real driver: every allocation and object of the primary context is
 * destroyed and its state reset. The context keeps its address (as a new one
 * may get a destroyed one's), but not its id: cuCtxGetId tells them apart. */
CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    context_t *ctx = primary[device];
    if (ctx) {
        destroy_context_objects_locked(ctx);
        ctx->sticky = 0;
        ctx->id = next_context_id++;
        pthread_cond_broadcast(&progress);
    }
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuCtxGetId(CUcontext ctx_handle, unsigned long long *id) {
    if (!initialized) return NOT_INITIALIZED;
    if (!id) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    context_t *ctx = ctx_handle ? ctx_handle : current_ctx();
    CUresult r = !ctx ? INVALID_CONTEXT : check_context(ctx);
    if (!r) *id = ctx->id;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    pthread_mutex_lock(&mu);
    CUresult r = ctx ? check_context(ctx) : SUCCESS;
    pthread_mutex_unlock(&mu);
    if (r) return r;
    if (!ctx) { if (ctx_depth) ctx_depth--; return SUCCESS; }
    if (ctx_depth) ctx_stack[ctx_depth - 1] = ctx; else ctx_stack[ctx_depth++] = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!initialized) return NOT_INITIALIZED;
    *pctx = current_ctx();
    return SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
    pthread_mutex_lock(&mu);
    CUresult r = check_context(ctx);
    pthread_mutex_unlock(&mu);
    if (r) return r;
    if (ctx_depth == 32) return INVALID_VALUE;
    ctx_stack[ctx_depth++] = ctx;
    return SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext *pctx) {
    if (!initialized) return NOT_INITIALIZED;
    if (!ctx_depth) return INVALID_CONTEXT;
    context_t *ctx = ctx_stack[--ctx_depth];
    if (pctx) *pctx = ctx;
    return SUCCESS;
}

static CUresult check_context(void *ctx);

static CUresult named_context(void *ctx_handle) {
    if (!ctx_handle) return SUCCESS;
    pthread_mutex_lock(&mu);
    CUresult r = check_context(ctx_handle);
    pthread_mutex_unlock(&mu);
    return r;
}

/* The _v2 forms (CUDA 13.0) name the context; NULL means the current one. */
CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx_handle) {
    if (!initialized) return NOT_INITIALIZED;
    context_t *ctx = ctx_handle ? ctx_handle : current_ctx();
    if (!ctx) return INVALID_CONTEXT;
    if (named_context(ctx_handle)) return INVALID_CONTEXT;
    if (!device) return INVALID_VALUE;
    *device = ctx->device;
    return SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) { return cuCtxGetDevice_v2(device, NULL); }

static int context_idle_locked(context_t *ctx);

CUresult cuCtxSynchronize_v2(CUcontext ctx_handle) {
    context_t *ctx = ctx_handle ? ctx_handle : current_ctx();
    if (!initialized) return NOT_INITIALIZED;
    if (!ctx) return INVALID_CONTEXT;
    if (named_context(ctx_handle)) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult r = unsafe_call_locked();
    if (!r) {
        while (!ctx->sticky && !context_idle_locked(ctx)) pthread_cond_wait(&progress, &mu);
        r = ctx->sticky;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuCtxSynchronize(void) { return cuCtxSynchronize_v2(NULL); }

/* ---- streams ---------------------------------------------------------------- */

CUresult cuStreamCreate(CUstream *phandle, unsigned int flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (flags & ~(unsigned)STREAM_NON_BLOCKING) return INVALID_VALUE;
    if (!phandle) return INVALID_VALUE;
    context_t *ctx = current_ctx();
    if (!ctx) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult r = ctx->sticky;
    stream_t *s = r ? NULL : new_stream_locked(ctx);
    if (!r && !s) r = OUT_OF_MEMORY;
    if (s) {
        s->flags = flags;
        ptrset_add(&live_stream_set, s);
        live_streams++;
        *phandle = s;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamDestroy(CUstream handle) {
    if (!initialized) return NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    CUresult r = SUCCESS;
    if ((uintptr_t)handle <= 2 || !ptrset_remove(&live_stream_set, handle)) {
        r = INVALID_HANDLE;
    } else {
        stream_t *s = handle;
        stream_leave_capture_locked(s);
        s->destroyed = 1; /* the thread drains the queue, then frees it */
        live_streams--;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamGetCtx(CUstream handle, CUcontext *pctx) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = resolve_stream(handle, &s);
    if (!r) *pctx = s->ctx;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamGetCtx_v2(CUstream handle, CUcontext *pctx, CUgreenCtx *pgreen) {
    CUresult r = cuStreamGetCtx(handle, pctx);
    if (!r && pgreen) *pgreen = NULL;
    return r;
}

static int stream_idle_locked(stream_t *s) { return !s->head && !s->busy; }

static int set_idle_locked(ptrset_t *set, context_t *ctx) {
    for (size_t i = 0; i < set->cap; i++) {
        stream_t *s = set->slots[i];
        if (s && (void *)s != TOMBSTONE && s->ctx == ctx && !stream_idle_locked(s)) return 0;
    }
    return 1;
}

static int context_idle_locked(context_t *ctx) {
    return set_idle_locked(&live_stream_set, ctx) && set_idle_locked(&per_thread_stream_set, ctx) &&
           (!ctx->default_stream || stream_idle_locked(ctx->default_stream));
}

/* Querying or synchronizing a capturing stream is refused and invalidates it. */
static CUresult not_capturing_locked(stream_t *s) {
    if (!s->capture) return SUCCESS;
    s->capture->invalidated = 1;
    return STREAM_CAPTURE_UNSUPPORTED;
}

CUresult cuStreamQuery(CUstream handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = resolve_stream(handle, &s);
    if (!r) r = unsafe_call_locked();
    if (!r) r = not_capturing_locked(s);
    if (!r) r = s->ctx->sticky ? s->ctx->sticky : stream_idle_locked(s) ? SUCCESS : NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamSynchronize(CUstream handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = resolve_stream(handle, &s);
    if (!r) r = unsafe_call_locked();
    if (!r) r = not_capturing_locked(s);
    if (!r) {
        while (!s->ctx->sticky && !stream_idle_locked(s)) pthread_cond_wait(&progress, &mu);
        r = s->ctx->sticky;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Resolve a stream and check its context is healthy, holding the lock. */
static CUresult usable_stream_locked(void *handle, stream_t **out) {
    CUresult r = resolve_stream(handle, out);
    if (!r && (*out)->ctx->sticky) r = (*out)->ctx->sticky;
    return r;
}

/* cuda.h lists CUDA_ERROR_INVALID_CONTEXT for the calls that queue work
 * (cuEventRecord, cuStreamWaitEvent, cuLaunchHostFunc): they need a current
 * context on the calling thread, even for a stream that names its own. */
static CUresult queuing_context(void) { return current_ctx() ? SUCCESS : INVALID_CONTEXT; }

/* The emulator's streams have one priority, 0: the range is [0, 0], as on a
 * device without priorities; a requested priority is clamped into it. */
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    if (least) *least = 0;
    if (greatest) *greatest = 0;
    return SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream *phandle, unsigned int flags, int priority) {
    (void)priority;
    return cuStreamCreate(phandle, flags);
}

/* ---- events ----------------------------------------------------------------- */

CUresult cuEventCreate(CUevent *phandle, unsigned int flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!phandle || (flags & ~(unsigned)EVENT_FLAGS)) return INVALID_VALUE;
    /* As the driver: an interprocess event keeps no timing. */
    if ((flags & EVENT_INTERPROCESS) && !(flags & EVENT_DISABLE_TIMING)) return INVALID_VALUE;
    context_t *ctx = current_ctx();
    if (!ctx) return INVALID_CONTEXT;
    event_t *e = calloc(1, sizeof *e);
    e->ctx = ctx;
    e->flags = flags;
    e->refs = 1;
    e->shared_fd = -1;
    if (flags & EVENT_INTERPROCESS) {
        int fd = memfd_create("asyncfence-emulated-ipc-event", MFD_CLOEXEC);
        void *map = MAP_FAILED;
        if (fd >= 0 && ftruncate(fd, sizeof(ipc_counts_t)) == 0)
            map = mmap(NULL, sizeof(ipc_counts_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) {
            if (fd >= 0) close(fd);
            free(e);
            return OUT_OF_MEMORY;
        }
        memcpy(((ipc_counts_t *)map)->magic, IPC_MAGIC, sizeof IPC_MAGIC);
        e->shared = map;
        e->shared_fd = fd;
    }
    pthread_mutex_lock(&mu);
    ptrset_add(&live_event_set, e);
    live_events++;
    events_created++;
    pthread_mutex_unlock(&mu);
    *phandle = e;
    return SUCCESS;
}

CUresult cuEventDestroy(CUevent handle) {
    if (!initialized) return NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    CUresult r = SUCCESS;
    if (!ptrset_remove(&live_event_set, handle)) {
        r = INVALID_HANDLE;
    } else {
        live_events--;
        event_unref_locked(handle); /* freed once queued records have run */
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventRecord(CUevent event_handle, CUstream stream_handle) {
    if (queuing_context()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    stream_t *s = NULL;
    CUresult r = resolve_event(event_handle, &e);
    if (!r) r = usable_stream_locked(stream_handle, &s);
    if (!r && e->ctx != s->ctx) r = INVALID_HANDLE;
    /* The emulator records an interprocess event in its exporter only. */
    if (!r && e->opened) r = NOT_SUPPORTED;
    if (!r && s->capture) {
        /* Captured: a fork/join marker of the capture, never a completion. */
        if (s->capture->invalidated) {
            r = STREAM_CAPTURE_INVALIDATED;
        } else {
            s->capture_ops++;
            if (s != s->capture->origin) s->joined = 0;
            e->captured = 1;
            e->capture_id = s->capture->id;
            e->capture_stream = s;
            e->capture_ops = s->capture_ops;
        }
    } else if (!r && legacy_implicit_locked(s, 1)) {
        r = STREAM_CAPTURE_IMPLICIT;
    } else if (!r) {
        op_t *op = new_op(OP_RECORD);
        op->event = e;
        op->generation = ++e->target;
        if (e->shared) __atomic_store_n(&e->shared->target, e->target, __ATOMIC_RELEASE);
        e->refs++;
        e->captured = 0;
        enqueue_locked(s, op);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventQuery(CUevent handle) {
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    CUresult r = resolve_event(handle, &e);
    if (!r) r = unsafe_call_locked();
    if (!r && e->captured) r = CAPTURED_EVENT;
    if (!r) r = e->ctx->sticky ? e->ctx->sticky : event_complete(e) ? SUCCESS : NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventSynchronize(CUevent handle) {
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    CUresult r = resolve_event(handle, &e);
    if (!r) r = unsafe_call_locked();
    if (!r && e->captured) r = CAPTURED_EVENT;
    if (!r) {
        e->refs++;
        while (!e->ctx->sticky && !event_complete(e)) {
            if (e->opened) { /* completed by another process: poll */
                pthread_mutex_unlock(&mu);
                sleep_ns(100000);
                pthread_mutex_lock(&mu);
            } else {
                pthread_cond_wait(&progress, &mu);
            }
        }
        r = e->ctx->sticky;
        event_unref_locked(e);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventElapsedTime(float *ms, CUevent start_handle, CUevent end_handle) {
    if (!ms) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    event_t *start = NULL, *end = NULL;
    CUresult r = resolve_event(start_handle, &start);
    if (!r) r = resolve_event(end_handle, &end);
    if (!r && ((start->flags | end->flags) & EVENT_DISABLE_TIMING)) r = INVALID_HANDLE;
    if (!r && (start->done < start->target || end->done < end->target)) r = NOT_READY;
    if (!r) *ms = (float)((double)((int64_t)(end->stamp_ns - start->stamp_ns)) / 1e6);
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamWaitEvent(CUstream stream_handle, CUevent event_handle, unsigned int flags) {
    if (flags != 0) return INVALID_VALUE;
    if (queuing_context()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    stream_t *s = NULL;
    CUresult r = resolve_event(event_handle, &e);
    if (!r) r = usable_stream_locked(stream_handle, &s);
    if (!r && e->captured) {
        capture_t *c = find_capture_locked(e->capture_id);
        if (!c) {
            r = CAPTURED_EVENT; /* its capture ended: it never completes */
        } else if (s->capture && s->capture != c) {
            r = STREAM_CAPTURE_ISOLATION;
            c->invalidated = s->capture->invalidated = 1;
        } else if (c->invalidated) {
            r = STREAM_CAPTURE_INVALIDATED;
        } else if (!s->capture) {
            capture_add_member_locked(c, s); /* a fork: s is captured from now on */
        } else {
            /* Within the capture: a join, if s waits for all of the source's work. */
            for (size_t i = 0; i < c->n_members; i++) {
                stream_t *source = c->members[i];
                if (source == e->capture_stream && source != s &&
                    source->capture_ops == e->capture_ops)
                    source->joined = 1;
            }
            s->capture_ops++;
            if (s != c->origin) s->joined = 0;
        }
    } else if (!r && s->capture) {
        /* Uncaptured work cannot be a dependency of a capture. */
        r = STREAM_CAPTURE_ISOLATION;
        s->capture->invalidated = 1;
    } else if (!r && legacy_implicit_locked(s, 1)) {
        r = STREAM_CAPTURE_IMPLICIT;
    } else if (!r) { /* any context: the wait happens on the device */
        op_t *op = new_op(OP_WAIT_EVENT);
        op->event = e;
        op->generation = event_target(e);
        e->refs++;
        enqueue_locked(s, op);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- interprocess events ------------------------------------------------------ */

CUresult cuIpcGetEventHandle(CUipcEventHandle *phandle, CUevent event_handle) {
    if (!phandle) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    CUresult r = resolve_event(event_handle, &e);
    if (!r && (!(e->flags & EVENT_INTERPROCESS) || e->opened)) r = INVALID_VALUE;
    if (!r) {
        ipc_handle_t handle = { .pid = (int32_t)getpid(), .fd = e->shared_fd };
        memcpy(handle.magic, IPC_MAGIC, sizeof handle.magic);
        memset(phandle, 0, sizeof *phandle);
        memcpy(phandle->reserved, &handle, sizeof handle);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuIpcOpenEventHandle(CUevent *phandle, CUipcEventHandle opaque) {
    if (!initialized) return NOT_INITIALIZED;
    if (!phandle) return INVALID_VALUE;
    context_t *ctx = current_ctx();
    if (!ctx) return INVALID_CONTEXT;
    ipc_handle_t handle;
    memcpy(&handle, opaque.reserved, sizeof handle);
    if (memcmp(handle.magic, IPC_MAGIC, sizeof handle.magic) != 0) return INVALID_VALUE;
    /* Only from another process, as the driver's IPC. */
    if (handle.pid == (int32_t)getpid()) return INVALID_CONTEXT;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)handle.pid, (int)handle.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return MAP_FAILED_CODE; /* the exporter exited, or is another user's */
    struct stat st;
    void *map = MAP_FAILED;
    /* The descriptor may since name another file: the event was destroyed. */
    if (fstat(fd, &st) == 0 && st.st_size == (off_t)sizeof(ipc_counts_t))
        map = mmap(NULL, sizeof(ipc_counts_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return MAP_FAILED_CODE;
    if (memcmp(((ipc_counts_t *)map)->magic, IPC_MAGIC, sizeof IPC_MAGIC) != 0) {
        munmap(map, sizeof(ipc_counts_t));
        return MAP_FAILED_CODE;
    }
    event_t *e = calloc(1, sizeof *e);
    e->ctx = ctx;
    e->flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING;
    e->refs = 1;
    e->shared = map;
    e->shared_fd = -1;
    e->opened = 1;
    pthread_mutex_lock(&mu);
    ptrset_add(&live_event_set, e);
    live_events++;
    pthread_mutex_unlock(&mu);
    *phandle = e;
    return SUCCESS;
}

/* Each device's UUID: the same in every process, as a real device's. */
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return INVALID_DEVICE;
    if (!uuid) return INVALID_VALUE;
    memset(uuid, 0, sizeof *uuid);
    memcpy(uuid, "afemu-device-", 13);
    ((unsigned char *)uuid)[13] = (unsigned char)device; /* device < MAX_DEVICES */
    return SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) { return cuDeviceGetUuid(uuid, device); }

/* ---- host functions ----------------------------------------------------------- */

static CUresult launch_host_func(void *stream_handle, CUhostFn fn, void *data, long *counter) {
    if (!fn) return INVALID_VALUE;
    if (queuing_context()) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *op = new_op(OP_HOST_FUNC);
        op->fn = fn;
        op->data = data;
        int captured = 0;
        r = submit_locked(s, op, &captured);
        if (!r) {
            (*counter)++;
            last_host_fn = (void *)fn;
            if (!captured) pending_host_funcs++;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuLaunchHostFunc(CUstream stream_handle, CUhostFn fn, void *data) {
    return launch_host_func(stream_handle, fn, data, &host_funcs_v1);
}

CUresult cuLaunchHostFunc_v2(CUstream stream_handle, CUhostFn fn, void *data, unsigned int sync_mode) {
    if (sync_mode > 1) return INVALID_VALUE;
    return launch_host_func(stream_handle, fn, data, &host_funcs_v2);
}

/* ---- stream memory operations ------------------------------------------------- */

static CUresult enqueue_value_op(enum op_kind kind, void *stream_handle, CUdeviceptr address,
                                 uint32_t value, unsigned int flags) {
    if (!address || (address & 3)) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *op = new_op(kind);
        op->address = (volatile uint32_t *)(uintptr_t)address;
        op->value = value;
        op->flags = flags;
        r = submit_locked(s, op, NULL);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr address, cuuint32_t value, unsigned int flags) {
    if ((flags & 0xf) > WAIT_VALUE_NOR) return INVALID_VALUE;
    return enqueue_value_op(OP_WAIT_VALUE, stream, address, value, flags);
}

CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr address, cuuint32_t value, unsigned int flags) {
    return enqueue_value_op(OP_WRITE_VALUE, stream, address, value, flags);
}

/* ---- memory ------------------------------------------------------------------- */

CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned int flags) {
    (void)flags;
    if (!initialized) return NOT_INITIALIZED;
    if (!pp || !bytes) return INVALID_VALUE;
    if (!current_ctx()) return INVALID_CONTEXT;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0) return OUT_OF_MEMORY;
    memset(p, 0, bytes);
    pthread_mutex_lock(&mu);
    live_host_allocs++;
    pthread_mutex_unlock(&mu);
    *pp = p;
    return SUCCESS;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytes) { return cuMemHostAlloc(pp, bytes, 0); }

/* As the real driver: freeing needs a current context. */
CUresult cuMemFreeHost(void *p) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    if (!p) return INVALID_VALUE;
    free(p);
    pthread_mutex_lock(&mu);
    live_host_allocs--;
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!pdptr || !p || flags) return INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing */
    return SUCCESS;
}

/* Host memory the caller allocated (shared memory, say), page-locked for the
 * device: here it is host memory already, so only the arguments are checked. */
CUresult cuMemHostRegister(void *p, size_t bytes, unsigned int flags) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    if (!p || !bytes || (flags & ~0xfu)) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    live_host_registrations++;
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuMemHostUnregister(void *p) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    if (!p) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = live_host_registrations ? SUCCESS : NOT_REGISTERED;
    if (!r) live_host_registrations--;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemAlloc_v2(CUdeviceptr *pdptr, size_t bytes) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    if (!pdptr || !bytes) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = unsafe_call_locked();
    pthread_mutex_unlock(&mu);
    if (r) return r;
    void *p = malloc(bytes);
    if (!p) return OUT_OF_MEMORY;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!initialized) return NOT_INITIALIZED;
    if (!current_ctx()) return INVALID_CONTEXT;
    free((void *)(uintptr_t)dptr);
    return SUCCESS;
}

CUresult cuMemAllocAsync(CUdeviceptr *pdptr, size_t bytes, CUstream stream_handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    pthread_mutex_unlock(&mu);
    if (r) return r;
    void *p = bytes ? malloc(bytes) : NULL;
    if (!p) return bytes ? OUT_OF_MEMORY : INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream_handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *op = new_op(OP_FREE);
        op->address = (volatile uint32_t *)(uintptr_t)dptr;
        r = submit_locked(s, op, NULL);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static CUresult enqueue_memset(CUdeviceptr dptr, unsigned value, size_t bytes, void *stream_handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *op = new_op(OP_MEMSET);
        op->address = (volatile uint32_t *)(uintptr_t)dptr;
        op->value = value;
        op->bytes = bytes;
        r = submit_locked(s, op, NULL);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemsetD8Async(CUdeviceptr dptr, unsigned char value, size_t count, CUstream stream) {
    return enqueue_memset(dptr, value, count, stream);
}

/* ---- stream capture and graphs ------------------------------------------------ */

CUresult cuStreamBeginCapture_v2(CUstream stream_handle, CUstreamCaptureMode capture_mode) {
    int mode = (int)capture_mode;
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r && is_legacy_stream(s)) r = STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot capture */
    if (!r && s->capture) r = ILLEGAL_STATE;
    if (!r) {
        capture_t *c = calloc(1, sizeof *c);
        c->id = next_capture_id++;
        c->mode = mode;
        c->thread = pthread_self();
        c->origin = s;
        c->next = captures;
        captures = c;
        capture_add_member_locked(c, s);
        s->joined = 1; /* the origin needs no joining */
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamBeginCapture(CUstream stream_handle) {
    return cuStreamBeginCapture_v2(stream_handle, MODE_GLOBAL);
}

CUresult cuStreamEndCapture(CUstream stream_handle, CUgraph *pgraph) {
    if (!pgraph) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = resolve_stream(stream_handle, &s);
    capture_t *c = r ? NULL : s->capture;
    if (!r && !c) r = ILLEGAL_STATE;
    if (!r && c->origin != s) r = STREAM_CAPTURE_UNMATCHED;
    if (!r && c->mode != MODE_RELAXED && !pthread_equal(c->thread, pthread_self()))
        r = STREAM_CAPTURE_WRONG_THREAD;
    if (!r) {
        if (c->invalidated) r = STREAM_CAPTURE_INVALIDATED;
        for (size_t i = 0; !r && i < c->n_members; i++)
            if (!c->members[i]->joined) r = STREAM_CAPTURE_UNJOINED;
        op_t *ops = end_capture_locked(c); /* in every case, as the real driver */
        *pgraph = NULL;
        if (r) {
            free_ops_locked(ops);
        } else {
            graph_t *g = calloc(1, sizeof *g);
            g->head = ops;
            ptrset_add(&graph_set, g);
            *pgraph = g;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Answers for the legacy stream while a blocking stream of its context captures:
 * STREAM_CAPTURE_IMPLICIT, and the capture stays valid (as the real driver). */
static CUresult capture_status_locked(void *stream_handle, CUstreamCaptureStatus *status, cuuint64_t *id) {
    stream_t *s = NULL;
    CUresult r = resolve_stream(stream_handle, &s);
    if (r) return r;
    if (legacy_implicit_locked(s, 0)) return STREAM_CAPTURE_IMPLICIT;
    capture_t *c = s->capture;
    if (status) *status = !c ? CAPTURE_NONE : c->invalidated ? CAPTURE_INVALIDATED : CAPTURE_ACTIVE;
    if (id && c) *id = c->id;
    return SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream_handle, CUstreamCaptureStatus *status) {
    if (!status) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = capture_status_locked(stream_handle, status, NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

/* The 11.3 signature; the graph and its dependencies are not modelled (NULL, 0). */
CUresult cuStreamGetCaptureInfo_v2(CUstream stream_handle, CUstreamCaptureStatus *status, cuuint64_t *id,
                                   CUgraph *graph, const CUgraphNode **deps, size_t *n_deps) {
    if (!status) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = capture_status_locked(stream_handle, status, id);
    pthread_mutex_unlock(&mu);
    if (!r) {
        if (graph) *graph = NULL;
        if (deps) *deps = NULL;
        if (n_deps) *n_deps = 0;
    }
    return r;
}

/* The 12.3 signature (cuStreamGetCaptureInfo in CUDA 13): edge data added. */
CUresult cuStreamGetCaptureInfo_v3(CUstream stream_handle, CUstreamCaptureStatus *status, cuuint64_t *id,
                                   CUgraph *graph, const CUgraphNode **deps,
                                   const CUgraphEdgeData **edges, size_t *n_deps) {
    CUresult r = cuStreamGetCaptureInfo_v2(stream_handle, status, id, graph, deps, n_deps);
    if (!r && edges) *edges = NULL;
    return r;
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    if (!mode) return INVALID_VALUE;
    int requested = (int)*mode;
    if (requested < MODE_GLOBAL || requested > MODE_RELAXED) return INVALID_VALUE;
    int previous = thread_capture_mode;
    thread_capture_mode = requested;
    *mode = (CUstreamCaptureMode)previous;
    return SUCCESS;
}

static op_t *copy_ops(op_t *op) {
    op_t *head = NULL, **tail = &head;
    for (; op; op = op->next) {
        op_t *copy = new_op(op->kind);
        *copy = *op;
        copy->next = NULL;
        *tail = copy;
        tail = &copy->next;
    }
    return head;
}

CUresult cuGraphDestroy(CUgraph handle) {
    if (!initialized) return NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    CUresult r = ptrset_remove(&graph_set, handle) ? SUCCESS : INVALID_VALUE;
    if (!r) {
        free_ops_locked(handle->head);
        free(handle);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *pexec, CUgraph graph_handle, unsigned long long flags) {
    (void)flags;
    if (!initialized) return NOT_INITIALIZED;
    if (!pexec) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = ptrset_find(&graph_set, graph_handle) == (size_t)-1 ? INVALID_VALUE : SUCCESS;
    if (!r) {
        graph_exec_t *exec = calloc(1, sizeof *exec);
        exec->head = copy_ops(graph_handle->head);
        ptrset_add(&graph_exec_set, exec);
        *pexec = exec;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuGraphExecDestroy(CUgraphExec handle) {
    if (!initialized) return NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    CUresult r = ptrset_remove(&graph_exec_set, handle) ? SUCCESS : INVALID_VALUE;
    if (!r) {
        free_ops_locked(handle->head);
        free(handle);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Replays the captured memsets on the stream, in order. */
CUresult cuGraphLaunch(CUgraphExec exec_handle, CUstream stream_handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = ptrset_find(&graph_exec_set, exec_handle) == (size_t)-1 ? INVALID_VALUE : SUCCESS;
    if (!r) r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *ops = copy_ops(exec_handle->head);
        while (ops) {
            op_t *next = ops->next;
            if (!r) r = submit_locked(s, ops, NULL); else drop_op_locked(ops);
            ops = next;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- errors ------------------------------------------------------------------- */

static const struct { CUresult code; const char *name, *text; } error_table[] = {
    { SUCCESS, "CUDA_SUCCESS", "no error" },
    { INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
    { OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory" },
    { NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error" },
    { NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
    { INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal" },
    { INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context" },
    { INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle" },
    { ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state" },
    { NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found" },
    { NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready" },
    { ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered" },
    { LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure" },
    { NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted" },
    { NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported" },
    { STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
      "operation not permitted when stream is capturing" },
    { STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
      "operation failed due to a previous error during capture" },
    { STREAM_CAPTURE_UNMATCHED, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
      "capture was not initiated in this stream" },
    { STREAM_CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
      "capturing stream has unjoined work" },
    { STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
      "dependency created on uncaptured work in another stream" },
    { STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
      "operation would make the legacy stream depend on a capturing blocking stream" },
    { CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
      "operation not permitted on an event last recorded in a capturing stream" },
    { STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
      "attempt to terminate a thread-local capture sequence from another thread" },
};

static int error_index(CUresult code) {
    for (size_t i = 0; i < sizeof error_table / sizeof *error_table; i++)
        if (error_table[i].code == code) return (int)i;
    return -1;
}

CUresult cuGetErrorName(CUresult code, const char **out) {
    int i = error_index(code);
    if (i < 0) { *out = NULL; return INVALID_VALUE; }
    *out = error_table[i].name;
    return SUCCESS;
}

CUresult cuGetErrorString(CUresult code, const char **out) {
    int i = error_index(code);
    if (i < 0) { *out = NULL; return INVALID_VALUE; }
    *out = error_table[i].text;
    return SUCCESS;
}

/* ---- the resolver cuda.bindings loads everything through ---------------------- */

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                             cuuint64_t flags, CUdriverProcAddressQueryResult *status);

static CUresult cuGetProcAddress_v1(const char *symbol, void **pfn, int cuda_version,
                                    cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

/* What cuGetProcAddress hands out: for (name, version) rows, the function of
 * the highest version at or below the caller's. Each row's function has the
 * type of cudaTypedefs.h's PFN_<name>_v<version> (checked with the header). */
#define ENTRY_POINTS(X) \
    X(cuInit, 2000, cuInit) \
    X(cuDriverGetVersion, 2020, cuDriverGetVersion) \
    X(cuGetErrorName, 6000, cuGetErrorName) \
    X(cuGetErrorString, 6000, cuGetErrorString) \
    X(cuDeviceGet, 2000, cuDeviceGet) \
    X(cuDeviceGetCount, 2000, cuDeviceGetCount) \
    X(cuDeviceGetName, 2000, cuDeviceGetName) \
    X(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute) \
    X(cuDeviceGetUuid, 9020, cuDeviceGetUuid) \
    X(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2) \
    X(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain) \
    X(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease) \
    X(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2) \
    X(cuCtxGetId, 12000, cuCtxGetId) \
    X(cuCtxSetCurrent, 4000, cuCtxSetCurrent) \
    X(cuCtxGetCurrent, 4000, cuCtxGetCurrent) \
    X(cuCtxPushCurrent, 4000, cuCtxPushCurrent) \
    X(cuCtxPopCurrent, 4000, cuCtxPopCurrent) \
    X(cuCtxGetDevice, 2000, cuCtxGetDevice) \
    X(cuCtxGetDevice, 13000, cuCtxGetDevice_v2) \
    X(cuCtxSynchronize, 2000, cuCtxSynchronize) \
    X(cuCtxSynchronize, 13000, cuCtxSynchronize_v2) \
    X(cuStreamCreate, 2000, cuStreamCreate) \
    X(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority) \
    X(cuCtxGetStreamPriorityRange, 5050, cuCtxGetStreamPriorityRange) \
    X(cuStreamDestroy, 4000, cuStreamDestroy) \
    X(cuStreamGetCtx, 9020, cuStreamGetCtx) \
    X(cuStreamGetCtx, 12050, cuStreamGetCtx_v2) \
    X(cuStreamQuery, 2000, cuStreamQuery) \
    X(cuStreamSynchronize, 2000, cuStreamSynchronize) \
    X(cuStreamWaitEvent, 3020, cuStreamWaitEvent) \
    X(cuStreamBeginCapture, 10000, cuStreamBeginCapture) \
    X(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2) \
    X(cuStreamEndCapture, 10000, cuStreamEndCapture) \
    X(cuStreamIsCapturing, 10000, cuStreamIsCapturing) \
    X(cuStreamGetCaptureInfo, 11030, cuStreamGetCaptureInfo_v2) \
    X(cuStreamGetCaptureInfo, 12030, cuStreamGetCaptureInfo_v3) \
    X(cuThreadExchangeStreamCaptureMode, 10010, cuThreadExchangeStreamCaptureMode) \
    X(cuGraphDestroy, 10000, cuGraphDestroy) \
    X(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags) \
    X(cuGraphExecDestroy, 10000, cuGraphExecDestroy) \
    X(cuGraphLaunch, 10000, cuGraphLaunch) \
    X(cuEventCreate, 2000, cuEventCreate) \
    X(cuEventDestroy, 4000, cuEventDestroy) \
    X(cuEventRecord, 2000, cuEventRecord) \
    X(cuEventQuery, 2000, cuEventQuery) \
    X(cuEventSynchronize, 2000, cuEventSynchronize) \
    X(cuEventElapsedTime, 2000, cuEventElapsedTime) \
    X(cuIpcGetEventHandle, 4010, cuIpcGetEventHandle) \
    X(cuIpcOpenEventHandle, 4010, cuIpcOpenEventHandle) \
    X(cuEventElapsedTime, 12080, cuEventElapsedTime) /* _v2: the same signature */ \
    X(cuLaunchHostFunc, 10000, cuLaunchHostFunc) \
    X(cuLaunchHostFunc, 13020, cuLaunchHostFunc_v2) \
    X(cuStreamWaitValue32, 8000, cuStreamWaitValue32) \
    X(cuStreamWriteValue32, 8000, cuStreamWriteValue32) \
    X(cuMemHostAlloc, 2020, cuMemHostAlloc) \
    X(cuMemHostRegister, 4000, cuMemHostRegister) \
    X(cuMemHostRegister, 6050, cuMemHostRegister) \
    X(cuMemHostUnregister, 4000, cuMemHostUnregister) \
    X(cuMemAllocHost, 3020, cuMemAllocHost_v2) \
    X(cuMemFreeHost, 2000, cuMemFreeHost) \
    X(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer_v2) \
    X(cuMemAlloc, 3020, cuMemAlloc_v2) \
    X(cuMemFree, 3020, cuMemFree_v2) \
    X(cuMemAllocAsync, 11020, cuMemAllocAsync) \
    X(cuMemFreeAsync, 11020, cuMemFreeAsync) \
    X(cuMemsetD8Async, 3020, cuMemsetD8Async) \
    X(cuGetProcAddress, 11030, cuGetProcAddress_v1) \
    X(cuGetProcAddress, 12000, cuGetProcAddress_v2)

static const struct { const char *name; int version; void *fn; } entry_points[] = {
#define ROW(name, version, fn) { #name, version, (void *)fn },
    ENTRY_POINTS(ROW)
#undef ROW
};

#ifdef ASYNCFENCE_WITH_CUDA_H
#if CUDA_VERSION < 13020
/* cuLaunchHostFunc_v2 came in CUDA 13.2, after this cuda.h: until the header
 * declares it, its type is the one cuda.bindings 13.x declares (cydriver.pxd). */
typedef CUresult (CUDAAPI *PFN_cuLaunchHostFunc_v13020)(CUstream hStream, CUhostFn fn, void *userData,
                                                        unsigned int syncMode);
#endif

/* The other PFN types a caller may call these functions through: a row's
 * function is handed out for every version up to the next row's (so for 11.7's
 * cuStreamWaitValue32_v2 and cuStreamWriteValue32_v2, of the same types as the
 * v1 forms), and for the per-thread-default-stream lookups too (the driver's
 * _ptsz variants). */
#define OTHER_TYPES(X) \
    X(PFN_cuStreamWaitValue32_v11070, cuStreamWaitValue32) \
    X(PFN_cuStreamWriteValue32_v11070, cuStreamWriteValue32) \
    X(PFN_cuStreamGetCtx_v9020_ptsz, cuStreamGetCtx) \
    X(PFN_cuStreamGetCtx_v12050_ptsz, cuStreamGetCtx_v2) \
    X(PFN_cuStreamQuery_v7000_ptsz, cuStreamQuery) \
    X(PFN_cuStreamSynchronize_v7000_ptsz, cuStreamSynchronize) \
    X(PFN_cuStreamWaitEvent_v7000_ptsz, cuStreamWaitEvent) \
    X(PFN_cuStreamBeginCapture_v10000_ptsz, cuStreamBeginCapture) \
    X(PFN_cuStreamBeginCapture_v10010_ptsz, cuStreamBeginCapture_v2) \
    X(PFN_cuStreamEndCapture_v10000_ptsz, cuStreamEndCapture) \
    X(PFN_cuStreamIsCapturing_v10000_ptsz, cuStreamIsCapturing) \
    X(PFN_cuStreamGetCaptureInfo_v11030_ptsz, cuStreamGetCaptureInfo_v2) \
    X(PFN_cuStreamGetCaptureInfo_v12030_ptsz, cuStreamGetCaptureInfo_v3) \
    X(PFN_cuGraphLaunch_v10000_ptsz, cuGraphLaunch) \
    X(PFN_cuEventRecord_v7000_ptsz, cuEventRecord) \
    X(PFN_cuLaunchHostFunc_v10000_ptsz, cuLaunchHostFunc) \
    X(PFN_cuStreamWaitValue32_v8000_ptsz, cuStreamWaitValue32) \
    X(PFN_cuStreamWaitValue32_v11070_ptsz, cuStreamWaitValue32) \
    X(PFN_cuStreamWriteValue32_v8000_ptsz, cuStreamWriteValue32) \
    X(PFN_cuStreamWriteValue32_v11070_ptsz, cuStreamWriteValue32) \
    X(PFN_cuMemAllocAsync_v11020_ptsz, cuMemAllocAsync) \
    X(PFN_cuMemFreeAsync_v11020_ptsz, cuMemFreeAsync) \
    X(PFN_cuMemsetD8Async_v7000_ptsz, cuMemsetD8Async)

/* A mismatch is a compile error, whatever the warning flags. */
#define CHECK_TYPE(pfn, fn) \
    _Static_assert(_Generic(&(fn), pfn: 1, default: 0), #fn " does not match " #pfn " of cudaTypedefs.h");
#define CHECK_ROW(name, version, fn) CHECK_TYPE(PFN_##name##_v##version, fn)
ENTRY_POINTS(CHECK_ROW)
OTHER_TYPES(CHECK_TYPE)
#undef CHECK_ROW
#undef CHECK_TYPE
#endif

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                             cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return INVALID_VALUE;
    /* The per-thread-default-stream variants resolve to the same functions, which
     * then treat handle 0 as the per-thread default stream (as _ptsz ones do). */
    if (flags & PROC_PER_THREAD_DEFAULT_STREAM) {
        pthread_mutex_lock(&mu);
        per_thread_mode = 1;
        pthread_mutex_unlock(&mu);
    }
    /* As the real driver: a version above its own is refused outright. */
    if (cuda_version > driver_version()) {
        *pfn = NULL;
        if (status) *status = PROC_VERSION_NOT_SUFFICIENT;
        return INVALID_VALUE;
    }
    /* ASYNCFENCE_EMULATED_HIDE names one entry point to leave out, as an old driver would. */
    const char *hidden = getenv("ASYNCFENCE_EMULATED_HIDE");
    int is_hidden = hidden && strcmp(hidden, symbol) == 0;
    void *best = NULL;
    int best_version = -1;
    for (size_t i = 0; !is_hidden && i < sizeof entry_points / sizeof *entry_points; i++) {
        if (strcmp(entry_points[i].name, symbol) == 0 && entry_points[i].version <= cuda_version &&
            entry_points[i].version > best_version) {
            best = entry_points[i].fn;
            best_version = entry_points[i].version;
        }
    }
    /* As the real driver: a symbol it lacks is a success with a null pointer,
     * and the status says CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND. */
    *pfn = best;
    if (status) *status = best ? PROC_FOUND : PROC_SYMBOL_NOT_FOUND;
    return SUCCESS;
}

/* ---- test hooks ----------------------------------------------------------------- */

int emu_is_emulated(void) { return 1; }

/* 1 where compiled against the toolkit's cuda.h (ASYNCFENCE_WITH_CUDA_H), else 0. */
int emu_built_with_cuda_h(void) {
#ifdef ASYNCFENCE_WITH_CUDA_H
    return 1;
#else
    return 0;
#endif
}

/* Hold a stream: work queued after the gate waits until emu_release(gate). */
void *emu_hold(void *stream_handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    gate_t *g = NULL;
    if (!usable_stream_locked(stream_handle, &s)) {
        g = calloc(1, sizeof *g);
        g->refs = 2; /* the caller's and the queued operation's */
        op_t *op = new_op(OP_GATE);
        op->gate = g;
        enqueue_locked(s, op);
    }
    pthread_mutex_unlock(&mu);
    return g;
}

void emu_release(void *gate) {
    pthread_mutex_lock(&mu);
    gate_t *g = gate;
    if (g && !g->open) {
        g->open = 1;
        pthread_cond_broadcast(&progress);
        gate_unref_locked(g);
    }
    pthread_mutex_unlock(&mu);
}

/* A fault that strikes when the stream reaches this point, like a failing kernel. */
CUresult emu_launch_fault(void *stream_handle, int code) {
    pthread_mutex_lock(&mu);
    stream_t *s = NULL;
    CUresult r = usable_stream_locked(stream_handle, &s);
    if (!r) {
        op_t *op = new_op(OP_FAULT);
        op->code = code;
        enqueue_locked(s, op);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult emu_inject_fault(void *ctx, int code) {
    pthread_mutex_lock(&mu);
    CUresult r = check_context(ctx);
    if (!r) {
        ((context_t *)ctx)->sticky = code;
        pthread_cond_broadcast(&progress);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Emulator only: a real context stays faulted until the process ends. */
CUresult emu_clear_fault(void *ctx) {
    pthread_mutex_lock(&mu);
    CUresult r = check_context(ctx);
    if (!r) ((context_t *)ctx)->sticky = 0;
    pthread_mutex_unlock(&mu);
    return r;
}

static long read_counter(long *counter) {
    pthread_mutex_lock(&mu);
    long value = *counter;
    pthread_mutex_unlock(&mu);
    return value;
}

long emu_live_events(void) { return read_counter(&live_events); }
long emu_live_streams(void) { return read_counter(&live_streams); }
long emu_pending_host_funcs(void) { return read_counter(&pending_host_funcs); }
long emu_events_created(void) { return read_counter(&events_created); }
long emu_live_host_allocs(void) { return read_counter(&live_host_allocs); }
long emu_host_funcs_v1(void) { return read_counter(&host_funcs_v1); }
long emu_host_funcs_v2(void) { return read_counter(&host_funcs_v2); }

/* The function pointer the latest host-function launch handed the driver. */
void *emu_last_host_fn(void) {
    pthread_mutex_lock(&mu);
    void *fn = last_host_fn;
    pthread_mutex_unlock(&mu);
    return fn;
}

/* The flags an event was created with, or -1 for a bad handle. */
int emu_event_flags(void *handle) {
    pthread_mutex_lock(&mu);
    event_t *e = NULL;
    int flags = resolve_event(handle, &e) ? -1 : (int)e->flags;
    pthread_mutex_unlock(&mu);
    return flags;
}
