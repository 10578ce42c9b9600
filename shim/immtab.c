/*
 * Immediate counters (IMMCOUNTER), owned by the worker thread. Arrivals that come before
 * an expectation are kept, not dropped. Open addressing with linear probing and
 * backward-shift deletion, so entries vanish once nothing is counted or expected.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static uint32_t slot_of(const afs_immtab *t, uint32_t imm)
{
    return (uint32_t)afs_mix64(imm) & (t->cap - 1);
}

int afs_immtab_init(afs_immtab *t)
{
    t->cap = 256;
    t->len = 0;
    t->e = calloc(t->cap, sizeof(*t->e));
    return t->e ? 0 : afs_fail(AFS_ENOMEM, "immediate table: out of memory");
}

void afs_immtab_destroy(afs_immtab *t)
{
    free(t->e); /* NULL for one never initialised (afs_immtab_get: created on first use) */
    memset(t, 0, sizeof(*t));
}

static int grow(afs_immtab *t)
{
    afs_imm_entry *old = t->e;
    uint32_t old_cap = t->cap;
    afs_imm_entry *e = calloc((size_t)old_cap * 2, sizeof(*e));
    if (!e)
        return AFS_ENOMEM;
    t->e = e;
    t->cap = old_cap * 2;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (!old[i].used)
            continue;
        uint32_t s = slot_of(t, old[i].imm);
        while (t->e[s].used)
            s = (s + 1) & (t->cap - 1);
        t->e[s] = old[i];
    }
    free(old);
    return 0;
}

afs_imm_entry *afs_immtab_get(afs_immtab *t, uint32_t imm, bool create)
{
    if (!t->e) { /* a table made on first use (engine.c zeroes it) */
        if (!create || afs_immtab_init(t) != 0)
            return NULL;
    }
    uint32_t s = slot_of(t, imm);
    while (t->e[s].used) {
        if (t->e[s].imm == imm)
            return &t->e[s];
        s = (s + 1) & (t->cap - 1);
    }
    if (!create)
        return NULL;
    if ((t->len + 1) * 2 > t->cap) {
        if (grow(t) != 0)
            return NULL;
        return afs_immtab_get(t, imm, true);
    }
    memset(&t->e[s], 0, sizeof(t->e[s]));
    t->e[s].used = 1;
    t->e[s].imm = imm;
    t->len++;
    return &t->e[s];
}

void afs_immtab_maybe_remove(afs_immtab *t, afs_imm_entry *e)
{
    if (e->arrived || e->expected)
        return;
    uint32_t mask = t->cap - 1;
    uint32_t i = (uint32_t)(e - t->e);
    t->e[i].used = 0;
    t->len--;
    /* backward-shift: move later entries of the probe run into the hole */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->e[j].used)
            break;
        uint32_t home = slot_of(t, t->e[j].imm);
        /* can entry j move to i? only if its home is not cyclically in (i, j] */
        bool in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (in_range)
            continue;
        t->e[i] = t->e[j];
        t->e[j].used = 0;
        i = j;
    }
}
