/*
 * metadata: the one rule that turns a JSON scalar of a fact's metadata
 * into the string that filters compare, shared by the fact store (get_all,
 * delete_all filters) and the index (search filters) so both filter alike.
 */
#ifndef IS_MEMORY_METADATA_H
#define IS_MEMORY_METADATA_H

#include <cJSON.h>

/* Strings as themselves, numbers in shortest round-trip form (integers
 * without a fraction), true / false / null; NULL for arrays, objects and
 * out of memory. free() the result. */
char *metadata_scalar_string(const cJSON *v);

#endif
