/* Vyukov's intrusive MPSC queue: producers do one atomic exchange, no locks. */
#include "internal.h"

void afs_mpsc_init(afs_mpsc *q)
{
    atomic_store_explicit(&q->stub.next, NULL, memory_order_relaxed);
    atomic_store_explicit(&q->head, &q->stub, memory_order_relaxed);
    q->tail = &q->stub;
}

void afs_mpsc_push(afs_mpsc *q, afs_qnode *n)
{
    atomic_store_explicit(&n->next, NULL, memory_order_relaxed);
    afs_qnode *prev = atomic_exchange_explicit(&q->head, n, memory_order_acq_rel);
    atomic_store_explicit(&prev->next, n, memory_order_release);
}

afs_qnode *afs_mpsc_pop(afs_mpsc *q)
{
    afs_qnode *tail = q->tail;
    afs_qnode *next = atomic_load_explicit(&tail->next, memory_order_acquire);
    if (tail == &q->stub) {
        if (!next)
            return NULL;
        q->tail = next;
        tail = next;
        next = atomic_load_explicit(&next->next, memory_order_acquire);
    }
    if (next) {
        q->tail = next;
        return tail;
    }
    afs_qnode *head = atomic_load_explicit(&q->head, memory_order_acquire);
    if (tail != head)
        return NULL; /* a producer is mid-push; it will be visible shortly */
    afs_mpsc_push(q, &q->stub);
    next = atomic_load_explicit(&tail->next, memory_order_acquire);
    if (next) {
        q->tail = next;
        return tail;
    }
    return NULL;
}

bool afs_mpsc_empty(afs_mpsc *q)
{
    afs_qnode *tail = q->tail;
    return tail == &q->stub && atomic_load_explicit(&tail->next, memory_order_acquire) == NULL &&
           atomic_load_explicit(&q->head, memory_order_acquire) == &q->stub;
}
