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

/* max |a[i] - ref[i]| over the range of ref: the measure every logits
 * comparison against a reference uses. */
double test_rel_range_err(const float *a, const float *ref, int32_t n);

/* Removes a directory and everything below it (links are removed, not
 * followed). 0 on success, -1 if anything could not be removed. */
int test_remove_tree(const char *path);

/* Whether a file (or anything) exists at path. */
bool test_file_exists(const char *path);

#endif
