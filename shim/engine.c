/*
 * Engine lifetime: loading the provider library, opening its NIC domains, the send and
 * receive buffer pools, the worker thread, and the synchronous control calls (memory
 * registration, peer and descriptor resolution) that the worker executes for callers.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

static int load_provider(const char *path, void **lib, const struct afp_ops **ops)
{
    if (!path || !path[0])
        return afs_fail(AFS_EPROVIDER, "no provider library path given");
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return afs_fail(AFS_EPROVIDER, "cannot load provider library %s: %s", path, dlerror());
    afp_get_ops_fn get = NULL;
    *(void **)(&get) = dlsym(h, "afp_get_ops");
    if (!get) {
        dlclose(h);
        return afs_fail(AFS_EPROVIDER, "%s does not export afp_get_ops (not a provider library)",
                        path);
    }
    const struct afp_ops *o = get();
    if (!o || o->size < offsetof(struct afp_ops, trywait) || o->major != AFP_ABI_MAJOR) {
        unsigned major = o ? o->major : 0;
        dlclose(h);
        return afs_fail(AFS_EPROVIDER,
                        "%s: provider ABI major version %u, this shim speaks %u",
                        path, major, AFP_ABI_MAJOR);
    }
    if (!AFP_HAS_OP(o, list_nics) || !AFP_HAS_OP(o, open) || !AFP_HAS_OP(o, close) ||
        !AFP_HAS_OP(o, caps) || !AFP_HAS_OP(o, address) || !AFP_HAS_OP(o, reg_mr) ||
        !AFP_HAS_OP(o, dereg_mr) || !AFP_HAS_OP(o, resolve) || !AFP_HAS_OP(o, post_writes) ||
        !AFP_HAS_OP(o, post_send) || !AFP_HAS_OP(o, post_recv) || !AFP_HAS_OP(o, poll) ||
        !AFP_HAS_OP(o, errbuf)) {
        dlclose(h);
        return afs_fail(AFS_EPROVIDER, "%s: provider table lacks a required operation",
                        path);
    }
    *lib = h;
    *ops = o;
    return 0;
}

/* Loading a provider (and whatever it links) keeps the process's signal dispositions
 * (process.c), as do the two calls that initialise the fabric library under it. */
int afs_load_provider(const char *path, void **lib, const struct afp_ops **ops)
{
    afs_sigkeep k;
    afs_sigkeep_begin(&k);
    int rc = load_provider(path, lib, ops);
    afs_sigkeep_end(&k);
    return rc;
}

static int list_nics_kept(const struct afp_ops *ops, const afp_open_args *a, afp_nic_info *out,
                          uint32_t max, uint32_t *n, char *err, size_t errlen)
{
    afs_sigkeep k;
    afs_sigkeep_begin(&k);
    int rc = ops->list_nics(a, out, max, n, err, errlen);
    afs_sigkeep_end(&k);
    return rc;
}

static int open_kept(const struct afp_ops *ops, const afp_open_args *a, afp_domain **dom,
                     char *err, size_t errlen)
{
    afs_sigkeep k;
    afs_sigkeep_begin(&k);
    int rc = ops->open(a, dom, err, errlen);
    afs_sigkeep_end(&k);
    return rc;
}

static void open_args(const afs_config *cfg, const afs_transport *t, afp_open_args *a)
{
    memset(a, 0, sizeof(*a));
    a->fabric_provider = t ? t->fabric_provider : cfg->fabric_provider;
    a->nic = t ? t->nic_name : cfg->nic;
    a->bind_addr = t ? t->bind_addr : cfg->bind_addr;
    a->flags = (cfg->flags & AFS_CFG_FORCE_EFA_MODES) ? AFP_OPEN_FORCE_EFA_MODES : 0;
    a->rx_depth = cfg->rx_depth;
    a->tx_depth = cfg->tx_depth;
}

int32_t afs_provider_probe(const afs_config *cfg, void *nics_out, uint32_t max, uint32_t *count,
                           char *name_out, uint32_t name_len)
{
    void *lib = NULL;
    const struct afp_ops *ops = NULL;
    char err[AFP_ERRTEXT_LEN] = "";
    if (!cfg || !count)
        return afs_fail(AFS_EINVAL, "probe: NULL argument");
    int rc = afs_load_provider(cfg->provider_lib, &lib, &ops);
    if (rc)
        return rc;
    afp_open_args a;
    open_args(cfg, NULL, &a);
    uint32_t n = 0;
    rc = list_nics_kept(ops, &a, (afp_nic_info *)nics_out, max, &n, err, sizeof(err));
    if (rc) {
        rc = afs_fail(rc, "%s", err[0] ? err : "provider found no NIC");
        goto out_close;
    }
    *count = n;
    if (ops->minor < 7) /* its afp_nic_info ended in `reserved`: no version to report */
        for (uint32_t i = 0; i < n && i < max; i++)
            ((afp_nic_info *)nics_out)[i].lib_version = 0;
    if (name_out && name_len) {
        snprintf(name_out, name_len, "%s", ops->name ? ops->name : "");
    }
out_close:
    dlclose(lib);
    return rc;
}


static int setup_pools(afs_engine *eng, uint32_t index)
{
    afs_nic *n = &eng->nics[index];
    const struct afp_ops *ops = n->ops;
    uint64_t sz = eng->cfg.max_msg_size;
    uint64_t rx_bytes = sz * eng->cfg.rx_depth, tx_bytes = sz * eng->cfg.tx_depth;
    uint64_t dummy_base;
    int rc;
    n->rx_buf = aligned_alloc(4096, (rx_bytes + 4095) & ~4095ull);
    n->tx_buf = aligned_alloc(4096, (tx_bytes + 4095) & ~4095ull);
    n->tx_free = calloc(eng->cfg.tx_depth, sizeof(uint32_t));
    n->rx_retry = calloc(eng->cfg.rx_depth, sizeof(uint32_t));
    if (!n->rx_buf || !n->tx_buf || !n->tx_free || !n->rx_retry)
        return afs_fail(AFS_ENOMEM, "cannot allocate message buffers (%llu bytes)",
                        (unsigned long long)(rx_bytes + tx_bytes));
    uint64_t rkey;
    rc = ops->reg_mr(n->dom, n->rx_buf, rx_bytes, 0, -1,
                          afs_mr_key(eng->key_secret, index, UINT64_MAX), &n->rx_mr, &n->rx_desc,
                          &rkey, &dummy_base);
    if (rc)
        return afs_fail(rc, "registering receive buffers: %s", ops->errbuf(n->dom));
    rc = ops->reg_mr(n->dom, n->tx_buf, tx_bytes, 0, -1,
                          afs_mr_key(eng->key_secret, index, UINT64_MAX - 1), &n->tx_mr,
                          &n->tx_desc, &rkey, &dummy_base);
    if (rc)
        return afs_fail(rc, "registering send buffers: %s", ops->errbuf(n->dom));
    for (uint32_t i = 0; i < eng->cfg.tx_depth; i++)
        n->tx_free[n->tx_free_len++] = eng->cfg.tx_depth - 1 - i;
    for (uint32_t i = 0; i < eng->cfg.rx_depth; i++) {
        rc = afs_post_rx(eng, index, i);
        if (rc)
            return afs_fail(rc, "posting receive %u: %s", i, ops->errbuf(n->dom));
    }
    return 0;
}

static void close_nic(afs_nic *n)
{
    if (!n->dom)
        goto out_free;
    if (n->rx_mr)
        n->ops->dereg_mr(n->dom, n->rx_mr);
    if (n->tx_mr)
        n->ops->dereg_mr(n->dom, n->tx_mr);
    n->ops->close(n->dom);
out_free:
    free(n->rx_buf);
    free(n->tx_buf);
    free(n->tx_free);
    free(n->rx_retry);
    memset(n, 0, sizeof(*n));
}

static int open_one_nic(afs_engine *eng, afs_transport *t, uint32_t index, const char *name)
{
    afp_open_args a;
    open_args(&eng->cfg, t, &a);
    a.nic = name;
    char err[AFP_ERRTEXT_LEN] = "";
    if (index >= AFS_ENG_NICS)
        return afs_fail(AFS_EINVAL, "at most %u NICs per engine", AFS_ENG_NICS);
    afs_nic *n = &eng->nics[index];
    n->ops = t->ops;
    n->tp = (uint32_t)(t - eng->tps);
    int rc = open_kept(t->ops, &a, &n->dom, err, sizeof(err));
    if (rc) {
        n->dom = NULL;
        return afs_fail(rc, "opening %s%s%s: %s", t->name, name ? " NIC " : "",
                        name ? name : "", err);
    }
    eng->nnics = index + 1; /* from here on close_nic releases it */
    t->count = index + 1 - t->first;
    if ((rc = t->ops->caps(n->dom, &n->caps)))
        return afs_fail(rc, "provider caps: %s", t->ops->errbuf(n->dom));
    if (n->caps.imm_size < 4)
        return afs_fail(AFS_EUNSUPPORTED, "%s carries %u-byte immediates; 4 are needed",
                        n->caps.provider, n->caps.imm_size);
    const afs_nic *first = &eng->nics[t->first];
    if (index > t->first && n->caps.flags != first->caps.flags)
        return afs_fail(AFS_EINVAL, "NIC %s behaves differently from the group's first NIC "
                                    "(capabilities 0x%x vs 0x%x)",
                        name ? name : "?", n->caps.flags, first->caps.flags);
    size_t alen = sizeof(n->addr);
    if ((rc = t->ops->address(n->dom, n->addr, &alen)))
        return afs_fail(rc, "provider address: %s", t->ops->errbuf(n->dom));
    n->addr_len = (uint32_t)alen;
    return setup_pools(eng, index);
}

/* The NICs of a transport's domain group: the names given, or the first `nics` usable. */
static int open_nics(afs_engine *eng, afs_transport *t)
{
    char names[AFS_MAX_NICS][AFP_NAME_LEN];
    uint32_t count = 0;
    int rc = 0;
    t->first = eng->nnics;
    if (t->nic_name && t->nic_name[0]) {
        const char *p = t->nic_name;
        while (*p) {
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            if (len == 0 || len >= AFP_NAME_LEN)
                return afs_fail(AFS_EINVAL, "bad NIC name in \"%s\"", t->nic_name);
            if (count == AFS_MAX_NICS)
                return afs_fail(AFS_EINVAL, "at most %u NICs per group", AFS_MAX_NICS);
            memcpy(names[count], p, len);
            names[count][len] = '\0';
            count++;
            p = end ? end + 1 : p + len;
        }
    } else if (t->nics_wanted > 1) {
        if (t->nics_wanted > AFS_MAX_NICS)
            return afs_fail(AFS_EINVAL, "at most %u NICs per group", AFS_MAX_NICS);
        afp_nic_info found[AFS_MAX_NICS];
        uint32_t n = 0;
        char err[AFP_ERRTEXT_LEN] = "";
        afp_open_args a;
        open_args(&eng->cfg, t, &a);
        rc = list_nics_kept(t->ops, &a, found, AFS_MAX_NICS, &n, err, sizeof(err));
        if (rc)
            return afs_fail(rc, "listing NICs: %s", err);
        if (n < t->nics_wanted)
            return afs_fail(AFS_ENODEV, "%u NICs asked for, %s sees %u", t->nics_wanted,
                            t->name, n);
        for (count = 0; count < t->nics_wanted; count++)
            snprintf(names[count], AFP_NAME_LEN, "%s", found[count].name);
    }
    if (count == 0)
        rc = open_one_nic(eng, t, t->first, NULL);
    for (uint32_t i = 0; i < count; i++)
        if ((rc = open_one_nic(eng, t, t->first + i, names[i])))
            return rc;
    if (rc)
        return rc;
    t->caps = eng->nics[t->first].caps.flags;
    t->max_write = eng->nics[t->first].caps.max_msg_size;
    return 0;
}

static int check_config(const afs_config *cfg, bool routed)
{
    if (!cfg || cfg->size != sizeof(afs_config))
        return afs_fail(AFS_EINVAL, "engine config: size mismatch (shim expects %zu bytes)",
                        sizeof(afs_config));
    if (!cfg->provider_name || (!routed && !cfg->fabric_provider))
        return afs_fail(AFS_EINVAL, "engine config: provider name missing");
    if (strlen(cfg->provider_name) > AFS_MAX_PROVNAME)
        return afs_fail(AFS_EINVAL, "provider name too long");
    if (cfg->max_msg_size < 64 || cfg->max_msg_size > (64u << 20))
        return afs_fail(AFS_EINVAL, "max_msg_size %u outside 64 B .. 64 MiB", cfg->max_msg_size);
    if (cfg->rx_depth < 1 || cfg->rx_depth > 65535 || cfg->tx_depth < 1 ||
        cfg->tx_depth > 65535)
        return afs_fail(AFS_EINVAL, "rx_depth/tx_depth must be 1..65535");
    if (cfg->max_imm_values > (1u << 24))
        return afs_fail(AFS_EINVAL, "max_imm_values %u above 16,777,216", cfg->max_imm_values);
    if (cfg->poll_mode != AFS_POLL_ADAPTIVE && cfg->poll_mode != AFS_POLL_SPIN)
        return afs_fail(AFS_EINVAL, "unknown poll mode %u", cfg->poll_mode);
    return 0;
}

static void engine_free(afs_engine *eng)
{
    afs_live_destroy(eng); /* (a no-op when afs_engine_destroy already stopped it) */
    for (uint32_t i = 0; i < eng->nnics; i++)
        close_nic(&eng->nics[i]);
    for (uint32_t t = 0; t < AFS_MAX_TRANSPORTS; t++) {
        afs_transport *tp = &eng->tps[t];
        if (tp->lib)
            dlclose(tp->lib);
        free(tp->lib_path);
        free(tp->name);
        free(tp->fabric_provider);
        free(tp->nic_name);
        free(tp->bind_addr);
    }
    afs_ring_destroy(&eng->ring);
    free(atomic_exchange(&eng->spare, NULL));
    afs_immtab_destroy(&eng->imm);
    afs_immtab_destroy(&eng->imm_dropped);
    free(eng->imm_dropped_bits);
    afs_slots_destroy(&eng->mrs);
    afs_slots_destroy(&eng->peers);
    afs_slots_destroy(&eng->remotes);
    afs_slots_destroy(&eng->watchers);
    afs_allow_destroy(eng);
    pthread_mutex_destroy(&eng->peer_lock);
    pthread_mutex_destroy(&eng->timing_lock);
    free(eng->timings);
    free(eng->down_peers);
    if (eng->wake_fd >= 0)
        close(eng->wake_fd);
    free(eng->provider_name);
    free(eng);
}

static void engine_teardown(afs_engine *eng);

static bool take_transport(afs_transport *t, const afs_transport_cfg *c)
{
    t->lib_path = dup_or_null(c->provider_lib);
    t->name = dup_or_null(c->provider_name);
    t->fabric_provider = dup_or_null(c->fabric_provider);
    t->nic_name = dup_or_null(c->nic);
    t->bind_addr = dup_or_null(c->bind_addr);
    t->nics_wanted = c->nics;
    t->reach = c->reach;
    return (t->lib_path || !c->provider_lib) && t->name && t->fabric_provider &&
           (t->nic_name || !c->nic) && (t->bind_addr || !c->bind_addr);
}

static int check_transports(const afs_transport_cfg *tps, uint32_t count)
{
    if (!tps || count == 0 || count > AFS_MAX_TRANSPORTS)
        return afs_fail(AFS_EINVAL, "routed engine: 1..%u transports, %u given",
                        AFS_MAX_TRANSPORTS, count);
    for (uint32_t i = 0; i < count; i++) {
        if (!tps[i].provider_name || !tps[i].fabric_provider || !tps[i].provider_name[0])
            return afs_fail(AFS_EINVAL, "routed engine: transport %u has no provider name", i);
        if (strlen(tps[i].provider_name) > AFS_MAX_PROVNAME)
            return afs_fail(AFS_EINVAL, "provider name too long");
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(tps[i].provider_name, tps[j].provider_name) == 0)
                return afs_fail(AFS_EINVAL, "routed engine: transport %s given twice",
                                tps[i].provider_name);
    }
    return 0;
}

static int engine_create(const afs_config *cfg, const afs_transport_cfg *tps, uint32_t ntp,
                         bool routed, afs_engine **out)
{
    int rc = check_config(cfg, routed);
    if (rc)
        return rc;
    if (!out)
        return afs_fail(AFS_EINVAL, "engine: NULL output");
    afs_engine *eng = calloc(1, sizeof(*eng));
    if (!eng)
        return afs_fail(AFS_ENOMEM, "engine: out of memory");
    eng->wake_fd = -1;
    eng->ring.event_fd = -1;
    eng->teardown = engine_teardown;
    eng->cfg = *cfg;
    if (!eng->cfg.max_imm_values)
        eng->cfg.max_imm_values = AFS_MAX_IMM_VALUES_DEFAULT;
    eng->provider_name = dup_or_null(cfg->provider_name);
    eng->routed = routed;
    eng->ntp = ntp;
    bool ok = eng->provider_name != NULL;
    for (uint32_t t = 0; t < ntp; t++)
        ok = take_transport(&eng->tps[t], &tps[t]) && ok;
    /* the engine's copies: the caller's strings may go once this returns */
    eng->cfg.provider_lib = eng->tps[0].lib_path;
    eng->cfg.provider_name = eng->provider_name;
    eng->cfg.fabric_provider = eng->tps[0].fabric_provider;
    eng->cfg.nic = eng->tps[0].nic_name;
    eng->cfg.bind_addr = eng->tps[0].bind_addr;
    if (!ok) { /* engine_free frees what was copied */
        rc = afs_fail(AFS_ENOMEM, "engine: out of memory");
        engine_free(eng);
        return rc;
    }
    afs_raise_fd_limit();
    eng->incarnation = afs_new_incarnation();
    eng->key_secret[0] = afs_random_u64();
    eng->key_secret[1] = afs_random_u64();
    atomic_store(&eng->next_id, 1);
    if (pthread_mutex_init(&eng->peer_lock, NULL) != 0) {
        free(eng);
        return afs_fail(AFS_ENOMEM, "engine: mutex init failed");
    }
    if (pthread_mutex_init(&eng->timing_lock, NULL) != 0) {
        pthread_mutex_destroy(&eng->peer_lock);
        free(eng);
        return afs_fail(AFS_ENOMEM, "engine: mutex init failed");
    }
    if (cfg->flags & AFS_CFG_TIMING) {
        eng->timing_cap = 1u << 16;
        eng->timings = calloc(eng->timing_cap, sizeof(afs_op_timing));
        if (!eng->timings) {
            rc = afs_fail(AFS_ENOMEM, "engine: out of memory for timing records");
            goto out_free;
        }
    }
    if ((rc = afs_slots_init(&eng->mrs, sizeof(afs_mr_entry))) ||
        (rc = afs_slots_init(&eng->peers, sizeof(afs_peer_entry))) ||
        (rc = afs_slots_init(&eng->remotes, sizeof(afs_remote_entry))) ||
        (rc = afs_slots_init(&eng->watchers, sizeof(afs_watcher))) ||
        (rc = afs_immtab_init(&eng->imm)) || (rc = afs_ring_init(&eng->ring, 65536)))
        goto out_free;
    afs_mpsc_init(&eng->submitq);
    eng->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (eng->wake_fd < 0) {
        rc = afs_fail(AFS_EIO, "eventfd: %s", strerror(errno));
        goto out_free;
    }
    for (uint32_t t = 0; t < ntp; t++) {
        afs_transport *tp = &eng->tps[t];
        if ((rc = afs_load_provider(tp->lib_path, &tp->lib, &tp->ops)))
            goto out_free;
        if ((rc = open_nics(eng, tp)))
            goto out_free;
    }
    /* by the preferred transport's kind: on a routed engine it carries the same-host
     * traffic, whose round trips are the short ones a yield would stretch */
    eng->look_yields = (eng->tps[0].caps & AFP_CAP_TARGET_COPIES) && afs_few_cpus();
    if (!routed)
        snprintf(eng->provider_full, sizeof(eng->provider_full), "%s",
                 eng->nics[0].caps.provider);
    else
        for (uint32_t t = 0, at = 0; t < ntp; t++) {
            int n = snprintf(eng->provider_full + at, sizeof(eng->provider_full) - at, "%s%s",
                             t ? "+" : "", eng->nics[eng->tps[t].first].caps.provider);
            if (n < 0 || (uint32_t)n >= sizeof(eng->provider_full) - at)
                break;
            at += (uint32_t)n;
        }
    const uint8_t *addrs[AFS_ENG_NICS];
    uint32_t lens[AFS_ENG_NICS];
    const char *names[AFS_MAX_TRANSPORTS];
    uint32_t tp_nics[AFS_MAX_TRANSPORTS];
    for (uint32_t i = 0; i < eng->nnics; i++) {
        addrs[i] = eng->nics[i].addr;
        lens[i] = eng->nics[i].addr_len;
    }
    for (uint32_t t = 0; t < ntp; t++) {
        names[t] = eng->tps[t].name;
        tp_nics[t] = eng->tps[t].count;
    }
    if ((rc = afs_addr_encode(routed, ntp, names, tp_nics, eng->incarnation,
                              eng->cfg.max_msg_size, addrs, lens, eng->address,
                              sizeof(eng->address), &eng->address_len)))
        goto out_free;

    if ((rc = afs_live_start(eng))) { /* peers.c: watches same-host peers and the worker */
        rc = afs_fail(rc, "cannot start the engine's watch thread");
        goto out_free;
    }
    if (pthread_create(&eng->worker, NULL, afs_worker_main, eng) != 0) {
        rc = afs_fail(AFS_ENOMEM, "cannot start the worker thread");
        goto out_free;
    }
    eng->worker_started = true;
    *out = eng;
    return 0;
out_free:
    engine_free(eng);
    return rc;
}

int32_t afs_engine_create(const afs_config *cfg, afs_engine **out)
{
    if (!cfg || cfg->size != sizeof(afs_config))
        return check_config(cfg, false);
    afs_transport_cfg one = {cfg->provider_lib, cfg->provider_name, cfg->fabric_provider,
                             cfg->nic, cfg->bind_addr, cfg->nics, AFS_REACH_NETWORK};
    if (cfg->provider_name && strlen(cfg->provider_name) > AFS_MAX_PROVNAME)
        return afs_fail(AFS_EINVAL, "provider name too long");
    return engine_create(cfg, &one, 1, false, out);
}

int32_t afs_engine_create_routed(const afs_config *cfg, const afs_transport_cfg *transports,
                                 uint32_t count, afs_engine **out)
{
    int rc = check_transports(transports, count);
    return rc ? rc : engine_create(cfg, transports, count, true, out);
}

/* How long closing waits for the worker to stop before giving up on it. */
#define AFS_CLOSE_WAIT_S 10ull

/* Waits for the worker until `deadline_ns` (afs_now_ns), telling providers of peers that
 * exit meanwhile: closing often follows a peer's death at once (the application saw the
 * process go before its pidfd said so), and the worker may be spinning on what it held. */
static int join_worker(afs_engine *eng, uint64_t deadline_ns)
{
    for (;;) {
        afs_live_sweep(eng);
        uint64_t now = afs_now_ns();
        uint64_t slice = deadline_ns > now ? deadline_ns - now : 0;
        if (slice > 20000000ull)
            slice = 20000000ull;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)slice;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        int rc = pthread_timedjoin_np(eng->worker, NULL, &until);
        if (rc != ETIMEDOUT || afs_now_ns() >= deadline_ns)
            return rc;
    }
}

int32_t afs_engine_destroy(afs_engine *eng)
{
    if (!eng)
        return afs_fail(AFS_EINVAL, "NULL engine");
    atomic_store(&eng->closed, 1);
    if (eng->watch_started) {
        atomic_store(&eng->watch_stop, 1);
        pthread_join(eng->watch_thread, NULL);
    }
    afs_live_stop(eng); /* before the worker: it submits to the worker's queue */
    if (eng->worker_started) {
        atomic_store(&eng->stop, 1);
        uint64_t one = 1;
        ssize_t w = write(eng->wake_fd, &one, sizeof(one));
        (void)w; /* the worker also wakes on its sleep timeout */
        /* known stuck: a moment, in case it just came back */
        uint64_t wait_ns = atomic_load(&eng->stuck) ? 100000000ull : AFS_CLOSE_WAIT_S * 1000000000ull;
        if (join_worker(eng, afs_now_ns() + wait_ns) != 0) {
            /* The worker is stuck inside the provider (seen: libfabric 1.17 shm spinning on a
             * lock in the shared region that a SIGKILLed peer held). Closing must not hang
             * the caller forever, and nothing the worker may still touch can be freed: the
             * engine becomes the worker's, freed by it if it ever returns (or left
             * allocated: a bounded leak). Nothing of `eng` is read after the handoff. */
            pthread_t worker = eng->worker;
            char provider[sizeof(eng->provider_full)];
            memcpy(provider, eng->provider_full, sizeof(provider));
            if (atomic_exchange(&eng->handoff, AFS_HANDOFF_CLOSER_LEFT) != AFS_HANDOFF_WORKER_DONE) {
                pthread_detach(worker);
                return afs_fail(AFS_ETIMEDOUT,
                                "closing: the worker did not stop (stuck inside provider %s); "
                                "the engine is freed if it ever does",
                                provider);
            }
            pthread_join(worker, NULL); /* it returned just now */
        }
    }
    engine_teardown(eng);
    return 0;
}

/* What closing does once the worker has returned: watchers, registrations, the rest. */
static void engine_teardown(afs_engine *eng)
{
    afs_watchers_destroy(eng);
    /* deregister what the application left registered before closing the domains */
    for (uint32_t i = 0; i < eng->mrs.n_alloc; i++) {
        afs_mr_entry *m = afs_slots_at(&eng->mrs, i);
        if (!m || !(atomic_load(&m->hdr.gen) & 1u))
            continue;
        for (uint32_t k = 0; k < eng->nnics; k++)
            if (m->mr[k])
                eng->nics[k].ops->dereg_mr(eng->nics[k].dom, m->mr[k]);
    }
    engine_free(eng);
}

int32_t afs_engine_info(afs_engine *eng, afs_engine_facts *out)
{
    if (!eng || !out)
        return afs_fail(AFS_EINVAL, "NULL argument");
    memset(out, 0, sizeof(*out));
    out->event_fd = eng->ring.event_fd;
    out->incarnation = eng->incarnation;
    /* a routed engine: what any of its transports does, and the largest write all take */
    for (uint32_t t = 0; t < eng->ntp; t++) {
        out->caps |= eng->tps[t].caps;
        if (!out->max_write_size || eng->tps[t].max_write < out->max_write_size)
            out->max_write_size = eng->tps[t].max_write;
    }
    out->max_msg_size = eng->cfg.max_msg_size;
    out->nics = eng->nnics;
    out->transports = eng->ntp;
    snprintf(out->provider, sizeof(out->provider), "%s", eng->provider_full);
    return 0;
}

int32_t afs_engine_transport(afs_engine *eng, uint32_t index, afs_transport_info *out)
{
    if (!eng || !out)
        return afs_fail(AFS_EINVAL, "NULL argument");
    if (index >= eng->ntp)
        return afs_fail(AFS_EINVAL, "transport %u of %u", index, eng->ntp);
    const afs_transport *t = &eng->tps[index];
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", t->name);
    snprintf(out->provider, sizeof(out->provider), "%s", eng->nics[t->first].caps.provider);
    out->first_nic = t->first;
    out->nics = t->count;
    out->caps = t->caps;
    out->reach = t->reach;
    out->max_write_size = t->max_write;
    return 0;
}

int32_t afs_timing_drain(afs_engine *eng, afs_op_timing *out, uint32_t max, uint32_t *count,
                         uint64_t *dropped)
{
    if (!eng || !out || !count || !dropped)
        return afs_fail(AFS_EINVAL, "timing_drain: NULL argument");
    if (!eng->timings)
        return afs_fail(AFS_EINVAL, "the engine was not created with timing on");
    pthread_mutex_lock(&eng->timing_lock);
    uint32_t n = eng->timing_len < max ? eng->timing_len : max;
    for (uint32_t i = 0; i < n; i++)
        out[i] = eng->timings[(eng->timing_head + i) % eng->timing_cap];
    eng->timing_head = (eng->timing_head + n) % eng->timing_cap;
    eng->timing_len -= n;
    *dropped = eng->timing_dropped;
    pthread_mutex_unlock(&eng->timing_lock);
    *count = n;
    return 0;
}

int32_t afs_engine_stats(afs_engine *eng, uint32_t nic, afs_nic_stats *out)
{
    if (!eng || !out)
        return afs_fail(AFS_EINVAL, "NULL argument");
    if (nic >= eng->nnics)
        return afs_fail(AFS_EINVAL, "NIC %u of %u", nic, eng->nnics);
    afs_nic *n = &eng->nics[nic];
    out->writes = atomic_load_explicit(&n->st_writes, memory_order_relaxed);
    out->write_bytes = atomic_load_explicit(&n->st_write_bytes, memory_order_relaxed);
    out->sends = atomic_load_explicit(&n->st_sends, memory_order_relaxed);
    out->recvs = atomic_load_explicit(&n->st_recvs, memory_order_relaxed);
    out->imms = atomic_load_explicit(&n->st_imms, memory_order_relaxed);
    out->errors = atomic_load_explicit(&n->st_errors, memory_order_relaxed);
    out->retries = atomic_load_explicit(&n->st_retries, memory_order_relaxed);
    out->landed = atomic_load_explicit(&n->st_landed, memory_order_relaxed);
    out->completions = atomic_load_explicit(&n->st_completions, memory_order_relaxed);
    out->rejected = atomic_load_explicit(&n->st_rejected, memory_order_relaxed);
    out->rejected_unknown = atomic_load_explicit(&n->st_rejected_unknown, memory_order_relaxed);
    out->imms_dropped = atomic_load_explicit(&n->st_imms_dropped, memory_order_relaxed);
    out->reads = atomic_load_explicit(&n->st_reads, memory_order_relaxed);
    out->read_bytes = atomic_load_explicit(&n->st_read_bytes, memory_order_relaxed);
    out->ctrl_sent = atomic_load_explicit(&n->st_ctrl_sent, memory_order_relaxed);
    out->ctrl_received = atomic_load_explicit(&n->st_ctrl_received, memory_order_relaxed);
    return 0;
}

int32_t afs_engine_worker_stats(afs_engine *eng, afs_worker_stats *out)
{
    if (!eng || !out)
        return afs_fail(AFS_EINVAL, "NULL argument");
    out->naps = atomic_load_explicit(&eng->worker_naps, memory_order_relaxed);
    return 0;
}

int32_t afs_engine_address(afs_engine *eng, uint8_t *buf, uint32_t cap, uint32_t *len)
{
    if (!eng || !buf || !len)
        return afs_fail(AFS_EINVAL, "NULL argument");
    if (cap < eng->address_len)
        return afs_fail(AFS_ERANGE, "address needs %u bytes", eng->address_len);
    memcpy(buf, eng->address, eng->address_len);
    *len = eng->address_len;
    return 0;
}

/* ---- synchronous control calls, executed by the worker ---- */

int32_t afs_mr_register(afs_engine *eng, uint64_t addr, uint64_t len, uint32_t flags,
                        int32_t device, uint64_t *mr_id, uint8_t *desc, uint32_t cap,
                        uint32_t *desc_len)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!mr_id || !desc_len)
        return afs_fail(AFS_EINVAL, "register: NULL output");
    if (len == 0 || addr == 0)
        return afs_fail(AFS_EINVAL, "register: empty region or NULL address");
    if (len > UINT64_MAX - addr)
        return afs_fail(AFS_EINVAL, "register: region wraps the address space");
    if (flags & ~(AFP_MR_REMOTE | AFP_MR_REMOTE_READ | AFP_MR_DEVICE))
        return afs_fail(AFS_EINVAL, "register: unknown flags 0x%x", flags);
    /* A provider from before reads would register a readable region without read access
     * (it ignores the flag): refuse rather than hand out a descriptor that says "r". */
    if (!eng->routed && (flags & AFP_MR_REMOTE_READ) &&
        !AFP_HAS_OP(eng->tps[0].ops, post_reads))
        return afs_fail(AFS_EUNSUPPORTED, "register: provider %s has no reads (remote=\"r\")",
                        eng->provider_name ? eng->provider_name : "?");
    if ((flags & AFP_MR_DEVICE) && device < 0)
        return afs_fail(AFS_EINVAL, "register: device memory needs a device id");
    uint32_t index;
    afs_mr_entry *m;
    if ((rc = afs_slots_alloc(&eng->mrs, &index, (void **)&m)))
        return rc;
    m->addr = addr;
    m->len = len;
    m->flags = flags;
    m->device = (flags & AFP_MR_DEVICE) ? device : -1;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_CTRL);
    if (!x) {
        rc = afs_fail(AFS_ENOMEM, "register: out of memory");
        goto out_slot;
    }
    x->ctrl.op = AFS_CTRL_REG;
    x->ctrl.mr = m;
    rc = afs_ctrl_call(eng, x);
    if (rc == AFS_ESTUCK)
        return rc; /* x and the entry stay the worker's */
    afs_xfer_free(x);
    if (rc)
        goto out_slot;
    *desc_len = 0;
    if (flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ)) {
        rc = afs_desc_encode(eng->address, eng->address_len, addr, len, m->device,
                             flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ), eng->nnics,
                             m->rbase, m->rkey, eng->routed, m->remote_mask, desc, cap,
                             desc_len);
        if (rc) {
            afs_xfer *d = afs_xfer_new(eng, AFS_REQ_CTRL);
            if (d) {
                d->ctrl.op = AFS_CTRL_DEREG;
                d->ctrl.mr = m;
                if (afs_ctrl_call(eng, d) == AFS_ESTUCK)
                    return rc; /* d and the entry stay the worker's */
                afs_xfer_free(d);
            }
            goto out_slot;
        }
    }
    *mr_id = afs_slots_publish(&eng->mrs, index);
    return 0;
out_slot:
    afs_slots_release(&eng->mrs, index);
    return rc;
}

int32_t afs_mr_deregister(afs_engine *eng, uint64_t mr_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    afs_mr_entry *m = afs_slots_lookup(&eng->mrs, mr_id);
    if (!m)
        return afs_fail(AFS_ESTALE, "memory region is not registered (already deregistered?)");
    /* Stale first: no new operation can start on it, then revoke at the provider. */
    afs_slots_release(&eng->mrs, (uint32_t)mr_id);
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_CTRL);
    if (!x)
        return afs_fail(AFS_ENOMEM, "deregister: out of memory");
    x->ctrl.op = AFS_CTRL_DEREG;
    x->ctrl.mr = m;
    rc = afs_ctrl_call(eng, x);
    if (rc != AFS_ESTUCK) /* else x stays the worker's */
        afs_xfer_free(x);
    return rc;
}

/* Whether a known peer lives at the NIC addresses of `v` (a restarted engine reuses them:
 * a fixed tcp port, an EFA QP number given out again). */
static bool same_nics(const afs_peer_entry *p, const afs_addr_view *v)
{
    afs_addr_view known;
    if (afs_addr_parse(p->addr, p->addr_len, &known) != 0 || known.nics != v->nics)
        return false;
    for (uint32_t k = 0; k < v->nics; k++)
        if (known.nic_addr_len[k] != v->nic_addr_len[k] ||
            memcmp(known.nic_addr[k], v->nic_addr[k], v->nic_addr_len[k]) != 0)
            return false;
    return true;
}

static int incarnation_plausible(uint64_t incarnation)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return 0; /* no clock to judge by: the proof rule alone (afs_peer_proven) */
    uint64_t now_us = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    uint64_t born_us = incarnation >> 12;
    if (born_us > now_us + AFS_INCARNATION_AHEAD_US)
        return afs_fail(AFS_EBADDESC,
                        "address or descriptor of engine %016llx: its incarnation is dated "
                        "%llu s ahead of this host's clock (at most %llu s allowed): refused",
                        (unsigned long long)incarnation,
                        (unsigned long long)((born_us - now_us) / 1000000u),
                        (unsigned long long)(AFS_INCARNATION_AHEAD_US / 1000000u));
    return 0;
}

int afs_restarted_error(uint64_t old_incarnation, uint64_t new_incarnation)
{
    return afs_fail(AFS_ESTALE,
                    "descriptor or address of engine %016llx, which has restarted as %016llx "
                    "at the same address: refused (its regions are gone)",
                    (unsigned long long)old_incarnation, (unsigned long long)new_incarnation);
}

/* Appends "name: why" to a peer's refusals (routed engines say why a transport was not
 * taken), or just "name" to a list when `why` is NULL. */
static void refuse_tp(char *buf, size_t len, const char *name, const char *why)
{
    size_t at = strlen(buf);
    if (at < len)
        snprintf(buf + at, len - at, "%s%s%s%s", at ? (why ? "; " : ", ") : "", name,
                 why ? ": " : "", why ? why : "");
}

/* Which of this engine's transports may reach the peer of address `v` (each must be named
 * in it, with as many NICs as ours; a same-host or same-node transport only to a process
 * of this host), and the peer's NIC addresses for each, by this engine's NIC. */
static int match_transports(afs_engine *eng, const afs_addr_view *v, afs_xfer *x,
                            uint32_t peer_tp[AFS_MAX_TRANSPORTS])
{
    afs_proc_id me = {0};
    (void)afs_proc_self(&me);
    for (uint32_t t = 0; t < eng->ntp; t++) {
        const afs_transport *tp = &eng->tps[t];
        uint32_t j = 0;
        while (j < v->ntp && strcmp(v->tp[j].name, tp->name) != 0)
            j++;
        if (j == v->ntp) {
            if (eng->routed)
                refuse_tp(x->ctrl.refused, sizeof x->ctrl.refused, tp->name,
                          "the peer has no such transport");
            continue;
        }
        if (v->tp[j].nics != tp->count) {
            if (!eng->routed)
                return afs_fail(AFS_EINVAL, "peer has %u NICs per group, this engine %u",
                                v->tp[j].nics, tp->count);
            char why[96];
            snprintf(why, sizeof why, "the peer has %u NICs in its group, this engine %u",
                     v->tp[j].nics, tp->count);
            refuse_tp(x->ctrl.refused, sizeof x->ctrl.refused, tp->name, why);
            continue;
        }
        if (eng->routed && tp->reach != AFS_REACH_NETWORK && v->proc.host && me.host &&
            v->proc.host != me.host) {
            refuse_tp(x->ctrl.refused, sizeof x->ctrl.refused, tp->name,
                      "the peer is on another host (kernel boot or PID namespace)");
            continue;
        }
        x->ctrl.tp_want |= 1u << t;
        peer_tp[t] = j;
        for (uint32_t i = 0; i < tp->count; i++) {
            x->ctrl.addr[tp->first + i] = v->nic_addr[v->tp[j].first + i];
            x->ctrl.addr_len[tp->first + i] = v->nic_addr_len[v->tp[j].first + i];
        }
    }
    if (!x->ctrl.tp_want) {
        char ours[96], theirs[96] = "";
        afs_tp_names(eng, (1u << eng->ntp) - 1u, ours, sizeof ours);
        for (uint32_t j = 0; j < v->ntp; j++)
            refuse_tp(theirs, sizeof theirs, v->tp[j].name, NULL);
        if (!eng->routed && v->ntp == 1)
            return afs_fail(AFS_EWRONGPROV, "peer uses provider %s, this engine %s",
                            v->provider, eng->provider_name);
        return afs_fail(AFS_EWRONGPROV, "no transport reaches the peer: this engine has %s, "
                                        "the peer %s%s%s",
                        ours, theirs, x->ctrl.refused[0] ? "; " : "", x->ctrl.refused);
    }
    return 0;
}

int afs_find_or_resolve_peer(afs_engine *eng, const afs_addr_view *v, const uint8_t *blob,
                             uint32_t blob_len, uint64_t *peer_id)
{
    int rc = 0;
    if (blob_len > sizeof(((afs_peer_entry *)0)->addr))
        return afs_fail(AFS_EBADDESC, "peer address too long (%u bytes)", blob_len);
    if ((rc = incarnation_plausible(v->incarnation)))
        return rc;
    pthread_mutex_lock(&eng->peer_lock);
    for (uint32_t i = 0; i < eng->peers.n_alloc; i++) {
        afs_peer_entry *p = afs_slots_at(&eng->peers, i);
        uint32_t gen = p ? atomic_load(&p->hdr.gen) : 0;
        if (!(gen & 1u))
            continue;
        if (p->addr_len == blob_len && memcmp(p->addr, blob, blob_len) == 0) {
            uint64_t later = atomic_load(&p->superseded_by);
            if (later) {
                rc = afs_restarted_error(p->incarnation, later);
                goto out_unlock;
            }
            *peer_id = ((uint64_t)gen << 32) | i;
            goto out_unlock;
        }
        /* Refused as from before a restart only where the later incarnation has proved
         * itself at these NIC addresses: a mere claim of a later one (a forged address or
         * descriptor) takes nothing away from the engine that lives there. */
        if (p->incarnation > v->incarnation && (atomic_load(&p->ka) & AFS_KA_PROVEN) &&
            same_nics(p, v)) {
            rc = afs_restarted_error(v->incarnation, p->incarnation);
            goto out_unlock;
        }
    }
    uint32_t index;
    afs_peer_entry *p;
    if ((rc = afs_slots_alloc(&eng->peers, &index, (void **)&p)))
        goto out_unlock;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_CTRL);
    if (!x) {
        afs_slots_release(&eng->peers, index);
        rc = afs_fail(AFS_ENOMEM, "resolve: out of memory");
        goto out_unlock;
    }
    x->ctrl.op = AFS_CTRL_RESOLVE;
    uint32_t peer_tp[AFS_MAX_TRANSPORTS] = {0};
    if ((rc = match_transports(eng, v, x, peer_tp)) == 0)
        rc = afs_ctrl_call(eng, x);
    if (rc == 0) {
        memcpy(p->fi_addr, x->ctrl.fi_addr, sizeof(p->fi_addr));
        p->tp_mask = x->ctrl.tp_got;
        memcpy(p->peer_tp, peer_tp, sizeof(p->peer_tp));
        memcpy(p->refused, x->ctrl.refused, sizeof(p->refused));
        p->incarnation = v->incarnation;
        p->max_msg = v->max_msg;
        p->pid = v->proc.pid;
        p->start = v->proc.start;
        p->addr_len = blob_len;
        memcpy(p->addr, blob, blob_len);
        for (uint32_t k = 0; k < eng->nnics; k++) { /* v was parsed from blob: in it */
            if (!(p->tp_mask & (1u << eng->nics[k].tp)))
                continue;
            uintptr_t at = (uintptr_t)x->ctrl.addr[k], from = (uintptr_t)blob;
            bool inside = at >= from && at - from + x->ctrl.addr_len[k] <= blob_len;
            p->nic_off[k] = inside ? (uint16_t)(at - from) : 0;
            p->nic_len[k] = inside ? (uint16_t)x->ctrl.addr_len[k] : 0;
        }
        *peer_id = afs_slots_publish(&eng->peers, index);
        afs_live_watch(eng, *peer_id, &v->proc); /* peers.c: reported up; watched if local */
    } else if (rc != AFS_ESTUCK) { /* stuck: x and the entry stay the worker's */
        afs_slots_release(&eng->peers, index);
    }
    if (rc != AFS_ESTUCK)
        afs_xfer_free(x);
out_unlock:
    pthread_mutex_unlock(&eng->peer_lock);
    return rc;
}

int32_t afs_peer_resolve(afs_engine *eng, const uint8_t *addr, uint32_t len, uint64_t *peer_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!peer_id)
        return afs_fail(AFS_EINVAL, "resolve: NULL output");
    afs_addr_view v;
    if ((rc = afs_addr_parse(addr, len, &v)) || (rc = afs_allow_check_addr(eng, &v, addr, len)))
        return rc;
    return afs_find_or_resolve_peer(eng, &v, addr, len, peer_id);
}

/* The checks the peer queries start with: an open engine, an output, a resolved peer. */
static int load_peer(afs_engine *eng, uint64_t peer_id, const void *out, const char *what,
                     afs_peer_entry **p)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!out)
        return afs_fail(AFS_EINVAL, "%s: NULL output", what);
    if (!(*p = afs_slots_lookup(&eng->peers, peer_id)))
        return afs_fail(AFS_ESTALE, "peer %llx is not resolved", (unsigned long long)peer_id);
    return 0;
}

int32_t afs_peer_handle(afs_engine *eng, uint64_t peer_id, uint64_t *handle)
{
    afs_peer_entry *p;
    int rc = load_peer(eng, peer_id, handle, "peer handle", &p);
    if (rc)
        return rc;
    *handle = afs_peer_src(eng, p, afs_peer_nic(eng, p));
    return 0;
}

int32_t afs_peer_source(afs_engine *eng, uint64_t peer_id, uint64_t src, uint32_t *match)
{
    afs_peer_entry *p;
    int rc = load_peer(eng, peer_id, match, "peer source", &p);
    if (rc)
        return rc;
    *match = 0;
    for (uint32_t t = 0; t < eng->ntp; t++)
        if ((p->tp_mask & (1u << t)) && afs_peer_src(eng, p, eng->tps[t].first) == src)
            *match = 1;
    return 0;
}

int32_t afs_peer_route(afs_engine *eng, uint64_t peer_id, int32_t device, uint32_t *transport,
                       char *why, uint32_t why_len)
{
    afs_peer_entry *p;
    int rc = load_peer(eng, peer_id, (!why && why_len) ? NULL : transport, "route", &p);
    if (rc)
        return rc;
    char refused[sizeof p->refused];
    memcpy(refused, p->refused, sizeof refused);
    uint32_t mask = p->tp_mask;
    if (!afs_slots_still(&eng->peers, peer_id))
        return afs_fail(AFS_ESTALE, "peer %llx is not resolved", (unsigned long long)peer_id);
    /* what a region of that kind registers with (afs_reg_flags), as a mask */
    uint32_t holds = 0;
    afs_mr_entry probe = {0};
    probe.flags = AFP_MR_REMOTE | (device >= 0 ? AFP_MR_DEVICE : 0u);
    probe.device = device;
    for (uint32_t t = 0; t < eng->ntp; t++) {
        uint32_t f = afs_reg_flags(eng, &eng->tps[t], &probe);
        if (f != UINT32_MAX && (f & AFP_MR_REMOTE))
            holds |= 1u << t;
    }
    if ((rc = afs_route_pick(eng, holds, mask, transport)))
        return rc;
    if (why_len)
        snprintf(why, why_len, "%s", refused);
    return 0;
}

int32_t afs_remote_import(afs_engine *eng, const uint8_t *desc, uint32_t len, uint64_t *remote_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!remote_id)
        return afs_fail(AFS_EINVAL, "import: NULL output");
    afs_desc_view d;
    if ((rc = afs_desc_parse(desc, len, &d)) ||
        (rc = afs_allow_check_addr(eng, &d.owner, d.addr_blob, d.addr_blob_len)))
        return rc;
    uint64_t peer_id;
    if ((rc = afs_find_or_resolve_peer(eng, &d.owner, d.addr_blob, d.addr_blob_len, &peer_id)))
        return rc;
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (!p)
        return afs_fail(AFS_ESTALE, "peer was forgotten during import");
    uint32_t index;
    afs_remote_entry *r;
    if ((rc = afs_slots_alloc(&eng->remotes, &index, (void **)&r)))
        return rc;
    r->peer_id = peer_id;
    memcpy(r->fi_addr, p->fi_addr, sizeof(r->fi_addr));
    r->length = d.length;
    r->access = d.access;
    /* the keys by this engine's NIC, on the transports that reach the owner and hold it */
    for (uint32_t t = 0; t < eng->ntp; t++) {
        const afs_transport *tp = &eng->tps[t];
        uint32_t j = p->peer_tp[t];
        if (!(p->tp_mask & (1u << t)) || !(d.tp_mask & (1u << j)))
            continue;
        for (uint32_t i = 0; i < tp->count; i++) {
            r->rbase[tp->first + i] = d.remote_base[d.owner.tp[j].first + i];
            r->key[tp->first + i] = d.key[d.owner.tp[j].first + i];
        }
        r->tp_mask |= 1u << t;
    }
    if (!r->tp_mask) {
        char held[96] = "";
        for (uint32_t j = 0; j < d.owner.ntp; j++)
            if (d.tp_mask & (1u << j))
                refuse_tp(held, sizeof held, d.owner.tp[j].name, NULL);
        char reach[96];
        afs_tp_names(eng, p->tp_mask, reach, sizeof reach);
        afs_slots_release(&eng->remotes, index);
        return afs_fail(AFS_EUNSUPPORTED, "descriptor of a %s region that its owner holds on "
                                          "%s, and this engine reaches the owner through %s "
                                          "only",
                        d.device >= 0 ? "CUDA" : "host", held, reach);
    }
    *remote_id = afs_slots_publish(&eng->remotes, index);
    return 0;
}

int32_t afs_remote_release(afs_engine *eng, uint64_t remote_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!afs_slots_lookup(&eng->remotes, remote_id))
        return afs_fail(AFS_ESTALE, "remote descriptor handle is not live");
    afs_slots_release(&eng->remotes, (uint32_t)remote_id);
    return 0;
}
