/*
 * verify: optional checksums of model files, checked at load.
 *
 * A flipped bit inside a tensor's data passes every structural check of
 * the GGUF and safetensors readers and loads silently; only a checksum of
 * the bytes catches it. The mechanism is a sidecar file in the format of
 * coreutils' sha256sum: next to MODEL.gguf, MODEL.gguf.sha256 holds the
 * SHA-256 of the whole file as 64 hex digits (the rest of the line, the
 * file name, is ignored). Make one with
 *
 *   sha256sum model.gguf > model.gguf.sha256
 *   sha256sum models/all-MiniLM-L6-v2/model.safetensors > models/all-MiniLM-L6-v2/model.safetensors.sha256
 *
 * When verification is on (`inferscale --verify ...`, verify_set_enabled),
 * gguf_open and safetensors_open hash the mapped file (about 1-2 s a GB)
 * and refuse it if the sidecar is missing, malformed or different. It is
 * off by default, since hashing a 16 GB model takes long.
 */
#ifndef IS_GGUF_VERIFY_H
#define IS_GGUF_VERIFY_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>

/* Process-wide: set once at start-up, before any model is opened. */
void verify_set_enabled(bool on);
bool verify_enabled(void);

/* Checks `len` bytes at `data` (the contents of the file at `path`)
 * against path's sidecar "<path>.sha256". IS_OK; IS_ERR_IO (no sidecar,
 * naming it and how to make one); IS_ERR_FORMAT (a malformed sidecar, or
 * a different hash: the file is damaged, both hashes named);
 * IS_ERR_UNSUPPORTED (built without nettle). */
is_status verify_sha256(const char *path, const void *data, size_t len);

/* The SHA-256 of len bytes as 64 lowercase hex digits and a NUL.
 * IS_ERR_UNSUPPORTED without nettle. */
is_status verify_sha256_hex(const void *data, size_t len, char out[65]);

#endif
