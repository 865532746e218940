/* The kvd_cuda_* calls from C, on a host without a GPU: every valid call answers
 * KVD_ERR_UNSUPPORTED with its detail (a libkvd built without the `cuda` feature, or no CUDA
 * driver on the host), and bad arguments (NULL pointers, no or too many layers) are
 * KVD_ERR_INVALID_ARGUMENT, never a crash. The copies themselves run in scripts/gpu-check.sh. */
#include "check.h"

#define LEN 4096

static uint8_t buf[LEN];

/* The last error is UNSUPPORTED, not retryable, and says why. */
static void expect_unsupported_detail(void) {
    KvdErrorInfo info;
    OK(kvd_last_error_info(&info));
    TRUE(info.status == KVD_ERR_UNSUPPORTED && !info.retryable);
    const char *m = kvd_last_error_message();
    TRUE(strstr(m, "built without CUDA (feature `cuda`)") != NULL ||
         strstr(m, "no CUDA driver (libcuda.so)") != NULL);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *c = connect_or_die(argv[1], "c-cuda", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    TRUE(strcmp(kvd_status_str(KVD_ERR_UNSUPPORTED), "unsupported") == 0);
    TRUE(KVD_CUDA_MAX_LAYERS == 1024);

    /* Registration: unsupported here, twice alike (nothing half-done). */
    EXPECT(kvd_cuda_register_pool(c), KVD_ERR_UNSUPPORTED);
    expect_unsupported_detail();
    EXPECT(kvd_cuda_register_pool(c), KVD_ERR_UNSUPPORTED);
    EXPECT(kvd_cuda_register_pool(NULL), KVD_ERR_INVALID_ARGUMENT);

    /* A block being written, and one pinned. */
    KvdKey k = test_key(ns, 40, 0);
    KvdAllocation a;
    int32_t st = -1;
    OK(kvd_alloc(c, &k, 1, NULL, 0, &a, &st));
    EXPECT(st, KVD_OK);
    KvdKey pk = test_key(ns, 41, 0);
    fill(buf, LEN, 5);
    put_block(c, pk, buf, LEN);
    KvdBlockInfo b;
    OK(kvd_acquire(c, &pk, 1, 0, &b, &st));
    EXPECT(st, KVD_OK);

    uint64_t ptrs[2] = {0x7f0000000000ull, 0x7f0000100000ull};
    uint64_t lens[2] = {2048, 2048};
    uint64_t ev = 12345;

    /* Valid calls: unsupported, with the detail; the event slot is not written. */
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, lens, 2, 0, &ev), KVD_ERR_UNSUPPORTED);
    expect_unsupported_detail();
    EXPECT(kvd_cuda_copy_from_block(c, &b.handle, ptrs, lens, 2, 0, &ev), KVD_ERR_UNSUPPORTED);
    expect_unsupported_detail();
    TRUE(ev == 12345);
    bool is_done = true;
    EXPECT(kvd_cuda_event_query(c, 1, &is_done), KVD_ERR_UNSUPPORTED);
    expect_unsupported_detail();
    EXPECT(kvd_cuda_event_wait(c, 1, 10), KVD_ERR_UNSUPPORTED);
    EXPECT(kvd_cuda_event_wait(c, 1, KVD_CUDA_WAIT_FOREVER), KVD_ERR_UNSUPPORTED);
    EXPECT(kvd_cuda_event_release(c, 1), KVD_ERR_UNSUPPORTED);
    expect_unsupported_detail();

    /* Bad arguments: errors, in every build, before anything else. */
    EXPECT(kvd_cuda_copy_to_block(NULL, &a.handle, ptrs, lens, 2, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_to_block(c, NULL, ptrs, lens, 2, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, NULL, lens, 2, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, NULL, 2, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, lens, 2, 0, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, lens, 0, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    /* Far more layers than the arrays hold: refused on the count, no element read. */
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, lens, KVD_CUDA_MAX_LAYERS + 1, 0, &ev),
           KVD_ERR_INVALID_ARGUMENT);
    TRUE(strstr(kvd_last_error_message(), "KVD_CUDA_MAX_LAYERS") != NULL);
    EXPECT(kvd_cuda_copy_to_block(c, &a.handle, ptrs, lens, (size_t)-1, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_from_block(c, NULL, ptrs, lens, 2, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_from_block(c, &b.handle, NULL, NULL, 1, 0, &ev), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_copy_from_block(c, &b.handle, ptrs, lens, KVD_CUDA_MAX_LAYERS + 1, 0, &ev),
           KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_event_query(c, 1, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_event_query(NULL, 1, &is_done), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_event_wait(NULL, 1, 0), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_cuda_event_release(NULL, 1), KVD_ERR_INVALID_ARGUMENT);

    /* The session is unharmed: the blocks are still usable. */
    OK(kvd_release(c, &b.handle, 1, &st));
    EXPECT(st, KVD_OK);
    OK(kvd_abort(c, &a.handle, 1, &st));
    EXPECT(st, KVD_OK);
    OK(kvd_close(c));
    EXPECT(kvd_cuda_register_pool(c), KVD_ERR_INVALID_ARGUMENT);
    done("cuda");
    return 0;
}
