/*
 * cli: what the subcommands of the inferscale program share: the default
 * model path, option parsing with clear errors, and a progress bar.
 */
#ifndef IS_TOOLS_CLI_H
#define IS_TOOLS_CLI_H

#include "kv/fact_record.h"

#include <stdbool.h>
#include <stdint.h>

#define CLI_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* $INFERSCALE_MODEL, else CLI_DEFAULT_MODEL. */
const char *cli_default_model(void);

/* Parse an option value in [lo, hi]; print one error line and return false
 * otherwise. */
bool cli_parse_int(const char *s, const char *what, int64_t lo, int64_t hi, int32_t *out);
bool cli_parse_float(const char *s, const char *what, float lo, float hi, float *out);
/* --kv-dtype: a record dtype by its name (kv_dtype_parse); one error line
 * naming the choices otherwise. */
bool cli_parse_kv_dtype(const char *s, kv_dtype *out);
/* --retrieval: "cpu" or "cuda" (*gpu = true: GPU retrieval, memory/dense_gpu.h). */
bool cli_parse_retrieval(const char *s, bool *gpu);

/* Progress of long work on stderr with rate and ETA: a bar redrawn in place
 * when stderr is a terminal (at most ~10 times a second), otherwise one plain
 * line every few seconds and one at the end.
 * t0_ms: when the work started (CLOCK_MONOTONIC ms). */
void cli_progress(const char *what, int64_t done, int64_t total, double t0_ms);

/* Subcommands. */
int cmd_ask(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_fsck(int argc, char **argv);
int cmd_ingest(int argc, char **argv);
int cmd_serve(int argc, char **argv);

#endif
