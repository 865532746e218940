/* What a client sees when its daemon drains and then dies. Driven by tests/ffi_c.rs over
 * stdin/stdout: the program holds a pin and says "pinned"; the harness starts a drain and
 * writes "drain"; the program checks UNAVAILABLE and says "drained"; the harness kills the
 * daemon (SIGKILL) and writes "killed"; the program checks DISCONNECTED. */
#include "check.h"

#define LEN 4096

static void wait_for(const char *word) {
    char line[64];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, word, strlen(word)) != 0) {
        fprintf(stderr, "drills: expected \"%s\" on stdin\n", word);
        exit(1);
    }
}

static void say(const char *word) {
    printf("%s\n", word);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *c = connect_or_die(argv[1], "c-drills", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    uint8_t buf[LEN];
    fill(buf, LEN, 4);
    KvdKey k = test_key(ns, 1, 0);
    put_block(c, k, buf, LEN);
    KvdBlockInfo b;
    int32_t st;
    OK(kvd_acquire(c, &k, 1, 60000, &b, &st));
    EXPECT(st, KVD_OK);
    say("pinned");

    /* Draining: no new session, no new allocation; what is held still reads. */
    wait_for("drain");
    KvdClientOptions o;
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    KvdClient *late = NULL;
    EXPECT(kvd_connect(argv[1], &o, &late), KVD_ERR_UNAVAILABLE);
    KvdKey k2 = test_key(ns, 1, 1);
    KvdAllocation a;
    int32_t call = kvd_alloc(c, &k2, 1, NULL, 0, &a, &st);
    TRUE(call == KVD_ERR_UNAVAILABLE || (call == KVD_OK && st == KVD_ERR_UNAVAILABLE));
    uint8_t back[LEN];
    uint64_t n;
    OK(kvd_read_verified(c, &b.handle, back, sizeof back, &n));
    TRUE(n == LEN && memcmp(back, buf, LEN) == 0);
    say("drained");

    /* Killed: the connection is gone, and so is every read of the mapping. */
    wait_for("killed");
    uint64_t ms;
    EXPECT(kvd_heartbeat(c, &ms), KVD_ERR_DISCONNECTED);
    KvdErrorInfo info;
    OK(kvd_last_error_info(&info));
    TRUE(info.status == KVD_ERR_DISCONNECTED && info.retryable);
    EXPECT(kvd_read(c, &b.handle, 0, back, 10), KVD_ERR_DISCONNECTED);
    KvdView v;
    EXPECT(kvd_view_acquire(c, &b.handle, &v), KVD_ERR_DISCONNECTED);
    bool broken = false;
    OK(kvd_lease_left(c, &ms, &broken));
    TRUE(broken);
    EXPECT(kvd_reconnect(c), KVD_ERR_IO); /* nobody listens any more */
    TRUE(kvd_close(c) != KVD_OK);         /* the goodbye fails, the client is freed */
    EXPECT(kvd_close(c), KVD_ERR_INVALID_ARGUMENT);
    done("drills");
    return 0;
}
