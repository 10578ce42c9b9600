/*
 * Stable tables (memory regions, peers, remote descriptors). Chunks are never freed
 * while the engine lives, so a submitting thread can read an element without a lock:
 * it checks the generation before and after copying (a seqlock) and gets AFS_ESTALE
 * for an id whose slot was released or reused.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int afs_slots_init(afs_slots *s, size_t elem_size)
{
    memset(s, 0, sizeof(*s));
    s->elem_size = elem_size;
    s->free_head = UINT32_MAX;
    if (pthread_mutex_init(&s->lock, NULL) != 0)
        return afs_fail(AFS_ENOMEM, "slot table: mutex init failed");
    return 0;
}

void afs_slots_destroy(afs_slots *s)
{
    for (uint32_t i = 0; i < AFS_SLOT_CHUNKS; i++)
        free(atomic_load(&s->chunks[i]));
    pthread_mutex_destroy(&s->lock);
}

void *afs_slots_at(afs_slots *s, uint32_t index)
{
    uint32_t c = index / AFS_SLOT_CHUNK;
    if (c >= AFS_SLOT_CHUNKS)
        return NULL;
    uint8_t *chunk = atomic_load_explicit(&s->chunks[c], memory_order_acquire);
    if (!chunk)
        return NULL;
    return chunk + (size_t)(index % AFS_SLOT_CHUNK) * s->elem_size;
}

int afs_slots_alloc(afs_slots *s, uint32_t *index, void **elem)
{
    int rc = 0;
    pthread_mutex_lock(&s->lock);
    uint32_t idx;
    if (s->free_head != UINT32_MAX) {
        idx = s->free_head;
        afs_slot_hdr *h = afs_slots_at(s, idx);
        s->free_head = h->next_free;
    } else {
        idx = s->n_alloc;
        uint32_t c = idx / AFS_SLOT_CHUNK;
        if (c >= AFS_SLOT_CHUNKS) {
            rc = afs_fail(AFS_ENOMEM, "slot table full (%u entries)", idx);
            goto out_unlock;
        }
        if (!atomic_load(&s->chunks[c])) {
            uint8_t *chunk = calloc(AFS_SLOT_CHUNK, s->elem_size);
            if (!chunk) {
                rc = afs_fail(AFS_ENOMEM, "slot table: out of memory");
                goto out_unlock;
            }
            atomic_store_explicit(&s->chunks[c], chunk, memory_order_release);
        }
        s->n_alloc++;
    }
    uint8_t *e = afs_slots_at(s, idx);
    afs_slot_hdr *h = (afs_slot_hdr *)e;
    /* keep the generation (even = not live), clear the payload */
    memset(e + sizeof(afs_slot_hdr), 0, s->elem_size - sizeof(afs_slot_hdr));
    h->next_free = UINT32_MAX;
    *index = idx;
    *elem = e;
out_unlock:
    pthread_mutex_unlock(&s->lock);
    return rc;
}

uint64_t afs_slots_publish(afs_slots *s, uint32_t index)
{
    afs_slot_hdr *h = afs_slots_at(s, index);
    uint32_t gen = atomic_load_explicit(&h->gen, memory_order_relaxed) + 1; /* odd: live */
    atomic_store_explicit(&h->gen, gen, memory_order_release);
    return ((uint64_t)gen << 32) | index;
}

void afs_slots_release(afs_slots *s, uint32_t index)
{
    afs_slot_hdr *h = afs_slots_at(s, index);
    pthread_mutex_lock(&s->lock);
    uint32_t gen = atomic_load_explicit(&h->gen, memory_order_relaxed);
    if (!(gen & 1u)) { /* already released: never push a slot twice */
        pthread_mutex_unlock(&s->lock);
        return;
    }
    atomic_store_explicit(&h->gen, gen + 1, memory_order_release);
    h->next_free = s->free_head;
    s->free_head = index;
    pthread_mutex_unlock(&s->lock);
}

void *afs_slots_lookup(afs_slots *s, uint64_t id)
{
    uint32_t index = (uint32_t)id;
    uint32_t gen = (uint32_t)(id >> 32);
    if (!(gen & 1u))
        return NULL;
    afs_slot_hdr *h = afs_slots_at(s, index);
    if (!h || atomic_load_explicit(&h->gen, memory_order_acquire) != gen)
        return NULL;
    return h;
}

bool afs_slots_still(afs_slots *s, uint64_t id)
{
    atomic_thread_fence(memory_order_acquire);
    return afs_slots_lookup(s, id) != NULL;
}
