/*
 * test_util: helpers several test programs need (linked into every test by
 * is_add_test in tests/CMakeLists.txt).
 */
#ifndef IS_TESTS_TEST_UTIL_H
#define IS_TESTS_TEST_UTIL_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

/* The whole file, NUL-terminated (the NUL is not counted), or NULL when it
 * cannot be opened or read. *n (may be NULL) gets its size. free() it. */
void *test_read_file(const char *path, size_t *n);

/* Writes data[0..n) to path, replacing what was there. True when every
 * byte was written and the file closed without error. */
bool test_write_file(const char *path, const void *data, size_t n);

/* max |a[i] - ref[i]| over the range of ref: the measure every logits
 * comparison against a reference uses. */
double test_rel_range_err(const float *a, const float *ref, int32_t n);

/* Removes a directory and everything below it (links are removed, not
 * followed). 0 on success, -1 if anything could not be removed. */
int test_remove_tree(const char *path);

/* Whether a file (or anything) exists at path. */
bool test_file_exists(const char *path);

/* A TCP connection to 127.0.0.1:port (the server under test), or -1. */
int test_connect_loopback(int port);

/* Skipped cases, so that a program whose every case skipped tells ctest so.
 *
 * A case that cannot run here (no default model, no LoCoMo, no embedder)
 * calls TEST_SKIP("needs ...") instead of cmocka's skip(): the reason is
 * printed and counted. main ends with
 *     return test_run_group(tests, setup, teardown);
 * which runs the group as cmocka_run_group_tests does and, when no case
 * failed and every case skipped, prints the reasons and returns
 * TEST_SKIP_CODE (77, the SKIP_RETURN_CODE every test has in ctest), so ctest
 * shows "Skipped" rather than "Passed". Some cases skipped and the rest passed
 * is still a pass, with the skipped count printed. */
#define TEST_SKIP_CODE 77
#define TEST_SKIP(reason)                                                                          \
    do {                                                                                           \
        test_note_skip(reason);                                                                    \
        skip();                                                                                    \
    } while (0)
#define test_run_group(tests, setup, teardown)                                                     \
    test_group_result(cmocka_run_group_tests(tests, setup, teardown),                              \
                      sizeof(tests) / sizeof((tests)[0]))

/* The usual reasons (IS_DEFAULT_MODEL and IS_SOURCE_DIR are defined for every
 * test by tests/CMakeLists.txt). */
#define TEST_NEEDS_MODEL                                                                           \
    "needs the default model " IS_DEFAULT_MODEL " (scripts/setup.sh installs it)"
#define TEST_NEEDS_EMBEDDER                                                                        \
    "needs the embedder models/all-MiniLM-L6-v2 (scripts/setup.sh installs it)"
#define TEST_NEEDS_LOCOMO "needs LoCoMo in ../shared/data/locomo"

/* Records one skipped case and prints why (to stderr). */
void test_note_skip(const char *reason);

/* cmocka's result for a group of n cases, or TEST_SKIP_CODE when it is 0 and
 * all n cases skipped. */
int test_group_result(int failures, size_t n);

#endif
