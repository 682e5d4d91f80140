/* Waiting on a flag word of the segment: the spin hint (cpu_relax), and sleeping in a futex on
 * the word until its owner, after publishing, wakes the sleepers (word_sleep / word_wake). Used
 * by protocol.c; included after shm.h (Python.h first). */
#ifndef COMMLIB_SHM_WAIT_H
#define COMMLIB_SHM_WAIT_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

/* ----- sleeping on a flag ------------------------------------------------------------------ */
/* A rank that has spun long enough sleeps in FUTEX_WAIT on the low 32 bits of the flag it waits
 * for; the owner of that flag wakes it after publishing a step. Measured on 4 ranks over 2 cores:
 * sched_yield hands the core to whichever task is next (often another waiting rank), while a
 * sleeping waiter leaves it to the rank that has work (see docs/shm.md, "Waiting").
 * No lost wake-up: the waiter increments `waiters` then re-reads the flag, the owner stores the
 * flag then reads `waiters`, all sequentially consistent, so one of them sees the other; and the
 * kernel re-checks the flag word before sleeping. Sleeps are bounded (CL_SLEEP_NS) so that dead
 * peers and signals are still noticed. */
#define CL_SLEEP_NS 2000000L
#ifdef __linux__
static inline uint32_t *low_word(_Atomic uint64_t *w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)w + 1;
#else
    return (uint32_t *)w;
#endif
}

/* Wake the ranks asleep on counter `w` (`waiters` of them), after storing it. */
static void word_wake(_Atomic uint64_t *w, _Atomic uint32_t *waiters) {
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0)
        syscall(SYS_futex, low_word(w), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Sleep until counter `w` may have reached `need` (or `ns` nanoseconds passed, < 1 s). */
static void word_sleep(_Atomic uint64_t *w, _Atomic uint32_t *waiters, uint64_t need, long ns) {
    atomic_fetch_add_explicit(waiters, 1, memory_order_seq_cst);
    uint64_t seen = atomic_load_explicit(w, memory_order_seq_cst);
    if (seen < need) {
        struct timespec ts = {0, ns};
        syscall(SYS_futex, low_word(w), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    }
    atomic_fetch_sub_explicit(waiters, 1, memory_order_seq_cst);
}
#else
static void word_wake(_Atomic uint64_t *w, _Atomic uint32_t *waiters) { (void)w, (void)waiters; }
static void word_sleep(_Atomic uint64_t *w, _Atomic uint32_t *waiters, uint64_t need, long ns) {
    (void)w, (void)waiters, (void)need, (void)ns;
    sched_yield();
}
#endif

/* ----- the segment lock -------------------------------------------------------------------- */
/* Held for one pass of progress (the steps that are ready) or one FIFO change, never while
 * sleeping; uncontended it costs one atomic exchange. */
static inline int lock_try(_Atomic int *l) {
    return atomic_exchange_explicit(l, 1, memory_order_acquire) == 0;
}

static inline void lock_take(_Atomic int *l) {
    for (unsigned long spins = 0; !lock_try(l); spins++) {
        if (spins < 1000)
            cpu_relax();
        else
            sched_yield();
    }
}

static inline void lock_drop(_Atomic int *l) { atomic_store_explicit(l, 0, memory_order_release); }

#endif
