/* libfabric 1.17's shm: wake-ups for an idle endpoint (ofi_wake.c). */
#ifndef OFI_WAKE_H
#define OFI_WAKE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

/* The shared word beside an endpoint's region: set while its worker sleeps on the socket. */
typedef struct ofi_wake_hdr {
    uint64_t magic;
    _Atomic uint32_t sleeping;
    uint32_t pid;
} ofi_wake_hdr;

/* Our own: the file holding the word (writers map it), the socket the worker sleeps on. */
typedef struct ofi_wake {
    ofi_wake_hdr *hdr; /* NULL: no wake-ups (the worker naps on timers, as before) */
    char *path;
    int fd;      /* bound to our abstract name: the domain's wait fd */
    int send_fd; /* unbound: kicks to peers */
} ofi_wake;

/* A peer's: its word (read-only), its socket's name. */
typedef struct ofi_wake_peer {
    ofi_wake_hdr *hdr; /* mapped read-only; NULL: the peer cannot be woken (not tried, or none) */
    struct sockaddr_un sa;
    socklen_t sa_len;
    bool tried;
} ofi_wake_peer;

/* Sets up wake-ups for the endpoint whose region is `region_path` ("/dev/shm/NAME");
 * 0, or -1 with nothing left behind (the endpoint then works without). */
__attribute__((visibility("hidden"))) int ofi_wake_open(ofi_wake *w, const char *region_path);
__attribute__((visibility("hidden"))) void ofi_wake_close(ofi_wake *w);

/* About to sleep: the word is set (sequentially consistent) before the caller's last look
 * at its command queue, as a writer posts before it looks at the word. */
__attribute__((visibility("hidden"))) void ofi_wake_sleepy(ofi_wake *w);
/* Awake again (any wake-up, or a sleep not taken): clears the word, drains the socket. */
__attribute__((visibility("hidden"))) void ofi_wake_awake(ofi_wake *w);

/* The peer whose region is `region_path`; a peer without wake-ups (or not ours) stays
 * without. Looked up once. */
__attribute__((visibility("hidden"))) void ofi_wake_peer_open(ofi_wake_peer *p,
                                                              const char *region_path);
/* After posting to it: whether it sleeps (its word, read after a full fence: our post
 * first); if so, one datagram wakes it. */
__attribute__((visibility("hidden"))) bool ofi_wake_sleeps(const ofi_wake_peer *p);
__attribute__((visibility("hidden"))) void ofi_wake_kick(const ofi_wake *w, const ofi_wake_peer *p);
__attribute__((visibility("hidden"))) void ofi_wake_peer_close(ofi_wake_peer *p);

#endif
