/* Asynchronous lookups: submit, wait on the eventfd, poll the completions; the queue's bound;
 * blocks pinned by an asynchronous lookup read through the same client; misuse. */
#include <poll.h>

#include "check.h"

#define LEN 4096

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *c = connect_or_die(argv[1], "c-async", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    uint8_t buf[LEN];
    fill(buf, LEN, 6);
    uint32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = (uint32_t)(500 + i);
    KvdTag tags[4];
    size_t ntags;
    OK(kvd_block_tags(&ns, 16, tokens, 64, tags, 4, &ntags));
    for (int i = 0; i < 3; i++) put_block(c, (KvdKey){ns, tags[i]}, buf, LEN);

    /* Not started yet; bad bounds. */
    int fd = -1;
    EXPECT(kvd_async_fd(c, &fd), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_async_start(c, 0), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_async_start(c, 2));
    EXPECT(kvd_async_start(c, 2), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_async_fd(c, &fd));
    TRUE(fd >= 0);

    /* Two in flight; the third is refused at once. */
    KvdBlockInfo pinned[4], plain[4], third[4];
    OK(kvd_async_lookup_prefix(c, &ns, tags, 4, true, 10000, 1, pinned, 4));
    OK(kvd_async_lookup_prefix(c, &ns, tags, 4, false, 0, 2, plain, 4));
    EXPECT(kvd_async_lookup_prefix(c, &ns, tags, 4, false, 0, 3, third, 4), KVD_ERR_OVERLOADED);
    EXPECT(kvd_async_lookup_prefix(c, &ns, tags, 4, false, 0, 3, third, 3), KVD_ERR_INVALID_ARGUMENT);

    /* Wait on the eventfd, then poll (bounded). */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    TRUE(poll(&p, 1, 30000) == 1 && (p.revents & POLLIN));
    KvdCompletion comp[4];
    int seen = 0, got_pinned = 0, got_plain = 0;
    for (int round = 0; round < 100 && seen < 2; round++) {
        size_t n = 0;
        OK(kvd_async_poll(c, 1000, comp, 4, &n));
        for (size_t i = 0; i < n; i++, seen++) {
            EXPECT(comp[i].status, KVD_OK);
            TRUE(comp[i].block_count == 3);
            if (comp[i].user_tag == 1) got_pinned = comp[i].pinned;
            if (comp[i].user_tag == 2) got_plain = !comp[i].pinned;
        }
    }
    TRUE(seen == 2 && got_pinned && got_plain);
    TRUE(memcmp(&pinned[2].key.tag, &tags[2], sizeof tags[2]) == 0);
    TRUE(memcmp(&plain[0].handle, &pinned[0].handle, sizeof(KvdHandle)) == 0);
    size_t n = 9;
    OK(kvd_async_poll(c, 0, comp, 4, &n)); /* nothing left: returns at once */
    TRUE(n == 0);

    /* The asynchronous pins are this client's: view them, release them. */
    KvdHandle hs[3];
    for (int i = 0; i < 3; i++) {
        KvdView v;
        OK(kvd_view_acquire(c, &pinned[i].handle, &v));
        TRUE(v.len == LEN && memcmp(v.data, buf, LEN) == 0);
        OK(kvd_view_still_valid(c, &v));
        hs[i] = pinned[i].handle;
    }
    int32_t st[3];
    OK(kvd_release(c, hs, 3, st));
    for (int i = 0; i < 3; i++) EXPECT(st[i], KVD_OK);

    /* A full queue frees up as completions are polled. */
    OK(kvd_async_lookup_prefix(c, &ns, tags, 4, false, 0, 4, third, 4));
    n = 0;
    for (int round = 0; round < 100 && n == 0; round++) OK(kvd_async_poll(c, 1000, comp, 4, &n));
    TRUE(n == 1 && comp[0].user_tag == 4 && comp[0].block_count == 3);

    /* Pins handed back on the queue: the completion counts what was released; handles already
     * released are not counted (and are no error); a NULL array is refused at submit. */
    KvdBlockInfo again[4];
    size_t got = 0;
    bool was_pinned = false;
    OK(kvd_lookup_prefix(c, &ns, tags, 4, true, 10000, again, 4, &got, &was_pinned));
    TRUE(got == 3 && was_pinned);
    for (int i = 0; i < 3; i++) hs[i] = again[i].handle;
    OK(kvd_async_release(c, hs, 3, 5));
    EXPECT(kvd_async_release(c, NULL, 3, 6), KVD_ERR_INVALID_ARGUMENT);
    n = 0;
    for (int round = 0; round < 100 && n == 0; round++) OK(kvd_async_poll(c, 1000, comp, 4, &n));
    TRUE(n == 1 && comp[0].user_tag == 5 && comp[0].status == KVD_OK && comp[0].block_count == 3);
    OK(kvd_async_release(c, hs, 3, 7));
    n = 0;
    for (int round = 0; round < 100 && n == 0; round++) OK(kvd_async_poll(c, 1000, comp, 4, &n));
    TRUE(n == 1 && comp[0].user_tag == 7 && comp[0].status == KVD_OK && comp[0].block_count == 0);

    /* Closing stops the queue; the handle is dead for it too. */
    OK(kvd_close(c));
    EXPECT(kvd_async_fd(c, &fd), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_async_poll(c, 0, comp, 4, &n), KVD_ERR_INVALID_ARGUMENT);
    done("async");
    return 0;
}
