#include "memory/metadata.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *metadata_scalar_string(const cJSON *v) {
    if (cJSON_IsString(v)) return strdup(v->valuestring);
    if (cJSON_IsTrue(v)) return strdup("true");
    if (cJSON_IsFalse(v)) return strdup("false");
    if (cJSON_IsNull(v)) return strdup("null");
    if (cJSON_IsNumber(v)) {
        char buf[64];
        double d = v->valuedouble;
        if (d == 0.0) {
            snprintf(buf, sizeof buf, "0");
        } else if (d == floor(d) && fabs(d) < 1e15) {
            snprintf(buf, sizeof buf, "%.0f", d);
        } else {
            for (int prec = 1; prec <= 17; prec++) {
                snprintf(buf, sizeof buf, "%.*g", prec, d);
                if (strtod(buf, NULL) == d) break;
            }
        }
        return strdup(buf);
    }
    return NULL;
}
