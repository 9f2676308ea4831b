/*
 * fuzz_fact_record: libFuzzer target for the fact-KV record parser.
 *
 * Each input is parsed twice: as it is, and with its checksum recomputed
 * (so mutations get past the checksum and reach the checks behind it).
 * Inputs are copied into a malloc'd buffer of exactly their size, so ASan
 * sees any read past the end. When a parse succeeds, the target checks what
 * the parser promises, with __builtin_trap() on a violation: the meta is
 * within the limits, the spans lie inside the buffer (every byte of them is
 * read), and re-encoding the parsed record gives back the input byte for
 * byte (version 1 has exactly one encoding of each record).
 */
#include "kv/fact_record.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

static volatile uint8_t sink;

static void touch(const uint8_t *buf, size_t size, const void *p, size_t n) {
    const uint8_t *b = p;
    CHECK(b >= buf && (size_t)(b - buf) <= size && n <= size - (size_t)(b - buf));
    uint8_t x = 0;
    for (size_t i = 0; i < n; i++) x ^= b[i];
    sink ^= x;
}

static void check_one(const uint8_t *buf, size_t size) {
    fact_kv_meta m;
    const int32_t *tokens = NULL;
    const void *k = NULL, *v = NULL;
    is_status st = fact_record_parse(buf, size, &m, &tokens, &k, &v);
    if (st != IS_OK) {
        CHECK(st == IS_ERR_FORMAT);
        CHECK(tokens == NULL && k == NULL && v == NULL);
        return;
    }
    CHECK(fact_meta_validate(&m) == IS_OK);
    CHECK(fact_meta_check(&m, &m) == IS_OK);
    size_t need = 0;
    CHECK(fact_record_size(&m, &need) == IS_OK && need == size);
    size_t kv_bytes = fact_kv_bytes(&m);
    touch(buf, size, tokens, (size_t)m.n_tokens * sizeof(int32_t));
    touch(buf, size, k, kv_bytes);
    touch(buf, size, v, kv_bytes);
    for (int32_t i = 0; i < m.n_tokens; i++) CHECK(tokens[i] >= 0);

    /* Widen the last row of each section, as injection would. */
    size_t row = fact_kv_row_elems(&m);
    float *f = malloc(row * sizeof(float));
    CHECK(f != NULL);
    fact_kv_to_f32(m.dtype, fact_kv_row(&m, k, m.n_layers - 1, m.n_tokens - 1), f, row);
    fact_kv_to_f32(m.dtype, fact_kv_row(&m, v, m.n_layers - 1, m.n_tokens - 1), f, row);
    free(f);

    uint8_t *again = malloc(size);
    CHECK(again != NULL);
    CHECK(fact_record_encode_into(&m, tokens, k, v, again, size) == IS_OK);
    CHECK(memcmp(again, buf, size) == 0);
    free(again);
}

/* Recomputes the checksum field (bytes 120..127) over the rest. */
static void reseal(uint8_t *b, size_t size) {
    uint8_t *cat = malloc(size - 8);
    if (!cat) return;
    memcpy(cat, b, 120);
    memcpy(cat + 120, b + 128, size - 128);
    uint64_t h = fact_text_hash((const char *)cat, size - 8);
    memcpy(b + 120, &h, 8);
    free(cat);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    check_one(buf, size);
    if (size >= FACT_RECORD_HEADER_BYTES) {
        reseal(buf, size);
        check_one(buf, size);
    }
    free(buf);
    return 0;
}
