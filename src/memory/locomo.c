#include "memory/locomo.h"

#include "core/status.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *dup_str(const char *s) { return strdup(s ? s : ""); }

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 65536 + 1 > cap) {
            cap = cap ? cap * 2 : 1 << 20;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, 65536, f);
        len += r;
        if (r == 0) break;
    }
    fclose(f);
    buf[len] = 0;
    *n = len;
    return buf;
}

void locomo_free(locomo_conv *c) {
    if (!c) return;
    for (int32_t i = 0; i < c->n_turns; i++) {
        free(c->turns[i].speaker);
        free(c->turns[i].dia_id);
        free(c->turns[i].text);
    }
    for (int32_t i = 0; i < c->n_facts; i++) {
        free(c->facts[i].speaker);
        free(c->facts[i].text);
        free(c->facts[i].dia_id);
        free(c->facts[i].date);
    }
    for (int32_t i = 0; i < c->n_questions; i++) {
        free(c->questions[i].question);
        free(c->questions[i].answer);
        for (int32_t j = 0; j < c->questions[i].n_evidence; j++) free(c->questions[i].evidence[j]);
        free(c->questions[i].evidence);
    }
    free(c->turns);
    free(c->facts);
    free(c->questions);
    free(c->name);
    free(c->speaker_a);
    free(c->speaker_b);
    free(c);
}

static int32_t find_turn(const locomo_conv *c, const char *dia_id) {
    for (int32_t i = 0; i < c->n_turns; i++)
        if (strcmp(c->turns[i].dia_id, dia_id) == 0) return i;
    return -1;
}

is_status locomo_load(const char *path, locomo_conv **out) {
    size_t n;
    char *text = read_all(path, &n);
    if (!text) return is_error_set(IS_ERR_IO, "locomo: cannot read '%s'", path);
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return is_error_set(IS_ERR_FORMAT, "locomo: '%s' is not a JSON object", path);
    }
    locomo_conv *c = calloc(1, sizeof *c);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    c->name = strndup(base, strcspn(base, "."));
    c->speaker_a = dup_str(cJSON_GetStringValue(cJSON_GetObjectItem(root, "speaker_a")));
    c->speaker_b = dup_str(cJSON_GetStringValue(cJSON_GetObjectItem(root, "speaker_b")));
    is_status st = IS_OK;
    /* Sessions are numbered from 1; stop at the first missing one. */
    for (int32_t s = 1; s < 1000 && st == IS_OK; s++) {
        char key[64];
        snprintf(key, sizeof key, "session_%d", s);
        const cJSON *sess = cJSON_GetObjectItem(root, key);
        if (!sess) {
            snprintf(key, sizeof key, "session_%d_date_time", s);
            if (cJSON_GetObjectItem(root, key)) continue; /* a dated session without turns */
            break;
        }
        if (!cJSON_IsArray(sess)) {
            st = is_error_set(IS_ERR_FORMAT, "locomo: %s: session_%d is not a list", path, s);
            break;
        }
        const cJSON *t;
        cJSON_ArrayForEach(t, sess) {
            const char *spk = cJSON_GetStringValue(cJSON_GetObjectItem(t, "speaker"));
            const char *dia = cJSON_GetStringValue(cJSON_GetObjectItem(t, "dia_id"));
            const char *tx = cJSON_GetStringValue(cJSON_GetObjectItem(t, "text"));
            const char *cap = cJSON_GetStringValue(cJSON_GetObjectItem(t, "blip_caption"));
            if (!spk || !dia || !tx) {
                st = is_error_set(IS_ERR_FORMAT,
                                  "locomo: %s: a turn of session %d lacks speaker, dia_id or text",
                                  path, s);
                break;
            }
            c->turns = realloc(c->turns, (size_t)(c->n_turns + 1) * sizeof *c->turns);
            locomo_turn *lt = &c->turns[c->n_turns++];
            size_t len = strlen(spk) + strlen(tx) + (cap ? strlen(cap) + 16 : 0) + 8;
            lt->text = malloc(len);
            if (cap) snprintf(lt->text, len, "%s: %s [shares %s]", spk, tx, cap);
            else snprintf(lt->text, len, "%s: %s", spk, tx);
            lt->speaker = dup_str(spk);
            lt->dia_id = dup_str(dia);
            lt->session = s;
        }
        char date[128] = "";
        snprintf(key, sizeof key, "session_%d_date_time", s);
        const char *when = cJSON_GetStringValue(cJSON_GetObjectItem(root, key));
        if (when) locomo_short_date(when, date, sizeof date);
        snprintf(key, sizeof key, "session_%d_observation", s);
        const cJSON *obs = cJSON_GetObjectItem(root, key), *who;
        cJSON_ArrayForEach(who, obs) {
            const cJSON *pair;
            cJSON_ArrayForEach(pair, who) {
                const char *ft = cJSON_GetStringValue(cJSON_GetArrayItem(pair, 0));
                const cJSON *ev = cJSON_GetArrayItem(pair, 1);
                /* A few observations cite several turns ("D8:6; D9:17"): the first counts. */
                const char *dia = cJSON_GetStringValue(ev);
                if (cJSON_IsArray(ev)) dia = cJSON_GetStringValue(cJSON_GetArrayItem(ev, 0));
                if (!ft || !*ft) continue;
                c->facts = realloc(c->facts, (size_t)(c->n_facts + 1) * sizeof *c->facts);
                locomo_fact *f = &c->facts[c->n_facts++];
                f->speaker = dup_str(who->string);
                f->text = dup_str(ft);
                f->dia_id = dia ? strndup(dia, strcspn(dia, "; ,")) : dup_str("");
                f->session = s;
                f->turn = -1;
                f->date = dup_str(date);
            }
        }
    }
    for (int32_t i = 0; i < c->n_facts; i++) c->facts[i].turn = find_turn(c, c->facts[i].dia_id);
    const cJSON *qa = cJSON_GetObjectItem(root, "qa"), *q;
    cJSON_ArrayForEach(q, qa) {
        if (st != IS_OK) break;
        const char *qs = cJSON_GetStringValue(cJSON_GetObjectItem(q, "question"));
        const cJSON *ans = cJSON_GetObjectItem(q, "answer");
        if (!ans) ans = cJSON_GetObjectItem(q, "adversarial_answer");
        const cJSON *cat = cJSON_GetObjectItem(q, "category");
        if (!qs || !cJSON_IsNumber(cat)) continue;
        c->questions = realloc(c->questions, (size_t)(c->n_questions + 1) * sizeof *c->questions);
        locomo_question *lq = &c->questions[c->n_questions++];
        memset(lq, 0, sizeof *lq);
        lq->question = dup_str(qs);
        if (cJSON_IsString(ans)) {
            lq->answer = dup_str(ans->valuestring);
        } else if (cJSON_IsNumber(ans)) {
            char num[64];
            snprintf(num, sizeof num, "%g", ans->valuedouble);
            lq->answer = dup_str(num);
        } else {
            lq->answer = dup_str("");
        }
        lq->category = cat->valueint;
        const cJSON *ev = cJSON_GetObjectItem(q, "evidence"), *e;
        cJSON_ArrayForEach(e, ev) {
            if (!cJSON_IsString(e)) continue;
            /* Entries like "D8:6; D9:17" name several turns. */
            const char *p = e->valuestring;
            while (*p) {
                p += strspn(p, "; ,");
                size_t l = strcspn(p, "; ,");
                if (!l) break;
                lq->evidence = realloc(lq->evidence, (size_t)(lq->n_evidence + 1) * sizeof(char *));
                lq->evidence[lq->n_evidence++] = strndup(p, l);
                p += l;
            }
        }
    }
    cJSON_Delete(root);
    if (st == IS_OK && c->n_turns == 0)
        st = is_error_set(IS_ERR_FORMAT, "locomo: %s has no sessions", path);
    if (st != IS_OK) {
        locomo_free(c);
        return st;
    }
    *out = c;
    return IS_OK;
}

char *locomo_short_date(const char *t, char *buf, size_t cap) {
    if (cap == 0) return buf;
    const char *on = strstr(t, " on ");
    const char *p = on ? on + 4 : t;
    size_t o = 0;
    for (; *p && o + 1 < cap; p++)
        if (*p != ',') buf[o++] = *p;
    buf[o] = 0;
    return buf;
}

int32_t locomo_fact_context(const locomo_conv *c, const locomo_fact *f, int32_t w,
                            const char **turns) {
    if (f->turn < 0 || w <= 0) return 0;
    int32_t first = f->turn - w < 0 ? 0 : f->turn - w;
    int32_t n = 0;
    for (int32_t i = first; i < f->turn; i++) turns[n++] = c->turns[i].text;
    return n;
}
