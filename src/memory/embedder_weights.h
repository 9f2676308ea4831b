/*
 * embedder_weights: the view of a loaded embedder that a backend's device
 * copy is made from (backend/retrieval.h's encoder_weights: configuration,
 * f32 weights and the tokenizer as a callback). Internal to the library;
 * the layer views are also the embedder's own representation of its layers
 * (embedder.c).
 *
 * The pointers are the embedder's own arrays (memory-mapped F32 tensors or
 * its converted copies): valid while the embedder lives, never to be
 * written.
 */
#ifndef IS_MEMORY_EMBEDDER_WEIGHTS_H
#define IS_MEMORY_EMBEDDER_WEIGHTS_H

#include "backend/retrieval.h"
#include "memory/embedder.h"

/* Fills *out with e's configuration, weights and tokenizer. For a device
 * embedder (embedder_create_on), those of the CPU embedder it was made
 * from. */
void embedder_get_weights(const embedder *e, encoder_weights *out);

#endif
