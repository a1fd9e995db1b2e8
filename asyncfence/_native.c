/*
 * asyncfence's native wake path: the completion signal that wakes an event loop.
 *
 * No Python C-API: the device runtime calls these functions on its own threads
 * (PoCL's device worker, the CUDA driver's callback thread), where Python must
 * never run. Python loads this library with ctypes.
 *
 * A mailbox belongs to one event loop. It owns a file descriptor that the loop
 * watches with its own selector (an eventfd, or the read end of a pipe), and a
 * lock-free list of the signals that fired. A slot is one armed signal: the
 * device runtime calls af_fire (a CUDA host function) or af_opencl_callback
 * (an OpenCL event callback) with it exactly once. Firing pushes the slot on
 * its mailbox's list, and writes the fd only if the list was empty: many
 * completions coalesce into one write and one wake. The loop drains the fd
 * first, then the list (the other order could lose a wake), and frees the
 * slots it took. Just woken, it may take the list alone
 * (af_mailbox_take_undrained) and drain on its next call: the fd stays
 * readable until then.
 *
 * The calls the loop makes on its wake path take the mailbox as their one
 * argument, and pass the rest through arrays inside it that Python reads and
 * writes in place: ctypes spends about a thousand instructions on each
 * argument of a call, more than the call itself.
 *
 * Lifetimes: C owns every slot and mailbox. A mailbox counts one reference
 * for its loop and one per slot armed and not yet taken, and closes its fd
 * only once the count is zero, so a late signal never writes into a file that
 * reused the number. A slot whose signal never fires (an OpenCL event that
 * failed, a CUDA host function after a context fault) is never freed: a few
 * bytes per fault. A process forked from the one that made a mailbox never
 * frees it nor closes its fd.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/eventfd.h>
#endif

#define AF_API __attribute__((visibility("default")))

/* The version of the interface below: Python refuses a library of another. */
#define AF_ABI_VERSION 2
/* Tokens handed over per take: the size of a mailbox's token array. */
#define AF_TAKE_BATCH 256
/* af_opencl_arm's answers besides OpenCL's own codes (0, or negative). */
#define AF_ARM_NO_MEMORY 1
#define AF_ARM_NO_ENTRY 2
#define AF_CL_COMPLETE 0

typedef void (*af_opencl_notify)(void *event, int32_t status, void *argument);
typedef int32_t (*af_set_event_callback)(void *event, int32_t type, af_opencl_notify notify,
                                          void *argument);

typedef struct af_mailbox af_mailbox;

typedef struct af_slot {
    struct af_slot *next; /* in the mailbox's fired list, once fired */
    af_mailbox *mailbox;
    uint64_t token;
} af_slot;

struct af_mailbox {
    _Atomic(af_slot *) fired; /* a stack: signals push, the loop takes it whole */
    atomic_long refs;
    atomic_int closed; /* the loop let go: fired slots are freed, not delivered */
    af_slot *taken; /* the loop's: fired slots not yet handed to Python */
    uint64_t arguments[2]; /* af_opencl_arm's: the event, then the token */
    uint64_t tokens[AF_TAKE_BATCH]; /* what the takes hand over */
    int read_fd;
    int write_fd; /* the same fd for an eventfd */
    pid_t owner;
};

static atomic_long live_slots;
static atomic_long live_mailboxes;
/* clSetEventCallback of the OpenCL library in use, once Python has found it. */
static _Atomic(af_set_event_callback) set_event_callback;

static void close_fds(af_mailbox *mailbox) {
    close(mailbox->read_fd);
    if (mailbox->write_fd != mailbox->read_fd) close(mailbox->write_fd);
}

static void mailbox_unref(af_mailbox *mailbox) {
    if (atomic_fetch_sub(&mailbox->refs, 1) != 1) return;
    /* Last reference: no signal can fire into it any more, and no slot is left. */
    close_fds(mailbox);
    free(mailbox);
    atomic_fetch_sub(&live_mailboxes, 1);
}

/* Free fired slots nobody will take; each held a reference. */
static void free_slots(af_mailbox *mailbox, af_slot *slot) {
    while (slot) {
        af_slot *next = slot->next;
        free(slot);
        atomic_fetch_sub(&live_slots, 1);
        mailbox_unref(mailbox);
        slot = next;
    }
}

#ifndef __linux__
static int set_flags(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return -1;
    return fcntl(fd, F_SETFD, FD_CLOEXEC);
}
#endif

/* A new mailbox, or NULL with errno set. */
AF_API af_mailbox *af_mailbox_new(void) {
    af_mailbox *mailbox = calloc(1, sizeof *mailbox);
    if (!mailbox) return NULL;
#ifdef __linux__
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) {
        free(mailbox);
        return NULL;
    }
    mailbox->read_fd = mailbox->write_fd = fd;
#else
    int fds[2];
    if (pipe(fds) != 0) {
        free(mailbox);
        return NULL;
    }
    if (set_flags(fds[0]) != 0 || set_flags(fds[1]) != 0) {
        int saved = errno;
        close(fds[0]);
        close(fds[1]);
        free(mailbox);
        errno = saved;
        return NULL;
    }
    mailbox->read_fd = fds[0];
    mailbox->write_fd = fds[1];
#endif
    atomic_init(&mailbox->fired, NULL);
    atomic_init(&mailbox->refs, 1);
    atomic_init(&mailbox->closed, 0);
    mailbox->owner = getpid();
    atomic_fetch_add(&live_mailboxes, 1);
    return mailbox;
}

/* The fd the loop watches for readability. */
AF_API int af_mailbox_fd(af_mailbox *mailbox) { return mailbox->read_fd; }

/* The loop lets go of its mailbox. The fd stays open while any slot is armed. */
AF_API void af_mailbox_close(af_mailbox *mailbox) {
    if (mailbox->owner != getpid()) return; /* a forked child: the parent's, not ours */
    /* Closed first, drained second: a signal that fires meanwhile either sees
     * the flag and frees its own slot, or was pushed before and is drained here
     * (every operation on `closed` and `fired` is sequentially consistent). */
    atomic_store(&mailbox->closed, 1);
    atomic_fetch_add(&mailbox->refs, 1); /* ours, until the slots are freed */
    af_slot *taken = mailbox->taken;
    mailbox->taken = NULL;
    free_slots(mailbox, taken);
    free_slots(mailbox, atomic_exchange(&mailbox->fired, NULL));
    mailbox_unref(mailbox); /* the extra one */
    mailbox_unref(mailbox); /* the loop's */
}

/* Hand up to `capacity` of the taken tokens to the loop, freeing their slots. */
static size_t hand_over(af_mailbox *mailbox, uint64_t *tokens, size_t capacity) {
    size_t count = 0;
    while (mailbox->taken && count < capacity) {
        af_slot *slot = mailbox->taken;
        mailbox->taken = slot->next;
        tokens[count++] = slot->token;
        free(slot);
        atomic_fetch_sub(&live_slots, 1);
        mailbox_unref(mailbox);
    }
    return count;
}

/*
 * Take up to AF_TAKE_BATCH fired tokens into the mailbox's token array
 * (af_mailbox_tokens). Drains the fd first, then the list. Returns how many it
 * took; fewer than AF_TAKE_BATCH means none are left. Only the mailbox's loop
 * calls it.
 */
AF_API size_t af_mailbox_take(af_mailbox *mailbox) {
    if (!mailbox->taken) {
#ifdef __linux__
        uint64_t count; /* one read resets an eventfd's counter */
        if (read(mailbox->read_fd, &count, sizeof count) < 0) {
            /* EAGAIN: nothing written since the last take */
        }
#else
        char scratch[64];
        while (read(mailbox->read_fd, scratch, sizeof scratch) > 0) {
        }
#endif
        mailbox->taken = atomic_exchange(&mailbox->fired, NULL);
    }
    return hand_over(mailbox, mailbox->tokens, AF_TAKE_BATCH);
}

/*
 * af_mailbox_take without the read: the list only, a system call less on a
 * loop just woken. If it takes anything, the fd stays readable (the first
 * signal after the last take wrote it, and only af_mailbox_take reads it), so
 * the loop calls back, and that call, af_mailbox_take, drains it.
 */
AF_API size_t af_mailbox_take_undrained(af_mailbox *mailbox) {
    if (!mailbox->taken) mailbox->taken = atomic_exchange(&mailbox->fired, NULL);
    return hand_over(mailbox, mailbox->tokens, AF_TAKE_BATCH);
}

/* Where the takes put the tokens: AF_TAKE_BATCH of them, read in place. */
AF_API uint64_t *af_mailbox_tokens(af_mailbox *mailbox) { return mailbox->tokens; }

/* Where af_opencl_arm finds its event and token, written in place before each call. */
AF_API uint64_t *af_mailbox_arguments(af_mailbox *mailbox) { return mailbox->arguments; }

/* The version of this interface, which Python checks before using the library. */
AF_API int af_abi_version(void) { return AF_ABI_VERSION; }

/* The AF_TAKE_BATCH this library was built with. */
AF_API size_t af_take_batch(void) { return AF_TAKE_BATCH; }

/* A slot to arm for `token`: its signal will post it to `mailbox`. NULL if out of memory. */
AF_API af_slot *af_slot_new(af_mailbox *mailbox, uint64_t token) {
    af_slot *slot = malloc(sizeof *slot);
    if (!slot) return NULL;
    slot->next = NULL;
    slot->mailbox = mailbox;
    slot->token = token;
    atomic_fetch_add(&mailbox->refs, 1);
    atomic_fetch_add(&live_slots, 1);
    return slot;
}

/* Free a slot whose arming failed: the runtime will never call it. */
AF_API void af_slot_discard(af_slot *slot) {
    af_mailbox *mailbox = slot->mailbox;
    free(slot);
    atomic_fetch_sub(&live_slots, 1);
    mailbox_unref(mailbox);
}

/* The signal, as a CUDA host function: `void f(void *)`. Called once per slot. */
AF_API void af_fire(void *argument) {
    af_slot *slot = argument;
    af_mailbox *mailbox = slot->mailbox;
    /* Once pushed, the slot (and its reference) is the loop's to take at any
     * moment: hold one of our own until we are done with the mailbox. */
    atomic_fetch_add(&mailbox->refs, 1);
    af_slot *head = atomic_load(&mailbox->fired);
    do {
        slot->next = head;
    } while (!atomic_compare_exchange_weak(&mailbox->fired, &head, slot));
    if (atomic_load(&mailbox->closed)) {
        /* Nobody will take it: free what is there (the loop may be doing the same). */
        free_slots(mailbox, atomic_exchange(&mailbox->fired, NULL));
    } else if (head == NULL) {
        uint64_t one = 1;
        ssize_t written;
        do {
            written = write(mailbox->write_fd, &one, sizeof one);
        } while (written < 0 && errno == EINTR);
        /* EAGAIN: the fd is already readable, which is all a write is for. */
    }
    mailbox_unref(mailbox);
}

/* The signal, as an OpenCL event callback. The status is never trusted: the loop queries. */
AF_API void af_opencl_callback(void *event, int32_t status, void *argument) {
    (void)event;
    (void)status;
    af_fire(argument);
}

/* Tell the shim the OpenCL library's clSetEventCallback, for af_opencl_arm. */
AF_API void af_set_opencl_entry(af_set_event_callback entry) {
    atomic_store(&set_event_callback, entry);
}

/*
 * Arm an OpenCL event's signal: a slot for the token, registered with
 * clSetEventCallback for CL_COMPLETE, in one call from the loop (the event
 * and the token are in af_mailbox_arguments). Returns 0 once armed, OpenCL's
 * code if it refused, AF_ARM_NO_MEMORY or AF_ARM_NO_ENTRY (no
 * af_set_opencl_entry yet); unless armed, the slot is freed. The runtime may
 * call the callback inside this call, on this thread: it runs no Python.
 */
AF_API int32_t af_opencl_arm(af_mailbox *mailbox) {
    af_set_event_callback entry = atomic_load(&set_event_callback);
    if (!entry) return AF_ARM_NO_ENTRY;
    af_slot *slot = af_slot_new(mailbox, mailbox->arguments[1]);
    if (!slot) return AF_ARM_NO_MEMORY;
    int32_t code = entry((void *)(uintptr_t)mailbox->arguments[0], AF_CL_COMPLETE,
                         af_opencl_callback, slot);
    if (code != 0) af_slot_discard(slot);
    return code;
}

/* For tests and statistics: slots allocated and not freed; mailboxes alive. */
AF_API long af_live_slots(void) { return atomic_load(&live_slots); }
AF_API long af_live_mailboxes(void) { return atomic_load(&live_mailboxes); }
