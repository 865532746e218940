/* The store's counters by name, as a C caller reads them: kvd_counter_count names, each
 * kvd_counter_name(i) until NULL, kvd_counters fills the values in that order and agrees with
 * KvdStats on the counters the struct keeps. Prints "counter NAME VALUE" per counter, so that
 * tests/ffi_c.rs can compare the list with the one declaration in kvd-core. */
#include "check.h"

#define MAX_COUNTERS 256
#define LEN 4096

static uint8_t data[LEN];

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    KvdClient *c = connect_or_die(argv[1], "c-counters", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    fill(data, LEN, 3);
    put_block(c, test_key(ns, 7, 0), data, LEN);

    size_t n = kvd_counter_count();
    TRUE(n > 0 && n <= MAX_COUNTERS);
    TRUE(kvd_counter_name(n) == NULL);
    uint64_t values[MAX_COUNTERS];
    EXPECT(kvd_counters(c, values, n - 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_counters(c, NULL, n), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_counters(c, values, n));
    KvdStats s;
    OK(kvd_stats(c, &s));
    for (size_t i = 0; i < n; i++) {
        const char *name = kvd_counter_name(i);
        TRUE(name != NULL && name[0] != '\0');
        if (strcmp(name, "blocks_published") == 0) {
            TRUE(values[i] >= 1 && values[i] == s.blocks_published);
        }
        if (strcmp(name, "lookups") == 0) TRUE(values[i] == s.lookups);
        printf("counter %s %llu\n", name, (unsigned long long)values[i]);
    }
    OK(kvd_close(c));
    done("counters");
    return 0;
}
