/*
 * bench_embed: sentence-embedding throughput of the memory layer's embedder.
 *
 *   bench_embed [-m MODEL_DIR] [-d LOCOMO_DIR] [-t THREADS] [-r REPS] [-n TEXTS] [-b 1,8,32]
 *
 * Texts are LoCoMo observations (the facts the memory layer stores; about 19
 * tokens each) read from LOCOMO_DIR/ *.json, or, when that folder is absent,
 * a built-in set of facts of the same length. For each batch size, one run
 * embeds TEXTS texts in calls of that many texts; a warm-up run comes first.
 * Prints the median embeddings/s of REPS runs and, for scripts, one CSV line
 * per batch size: embed,<batch>,<threads>,<median embeddings/s>
 */
#include "memory/embedder.h"
#include "bench_util.h"

#include <cJSON.h>
#include <dirent.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char *const builtin[] = {
    "Caroline attended an LGBTQ support group recently and found the transgender stories "
    "inspiring.",
    "Melanie painted a lake sunrise last year which holds special meaning to her.",
    "Jon lost his job as a banker and decided to open his own dance studio.",
    "Gina launched an online clothing store after being laid off from her job.",
    "John saw Imagine Dragons live in Seattle in 2022 and loved the show.",
    "Maria volunteers at a homeless shelter every Saturday morning.",
    "Audrey adopted two dachshunds named Pepper and Panda last spring.",
    "Nate won his first video game tournament playing Street Fighter.",
    "Tim is writing a fantasy novel inspired by the books he read as a child.",
    "Deborah keeps her late mother's garden alive and plants roses every year.",
    "Evan had a minor car accident in March but nobody was hurt.",
    "Joanna is allergic to cats, so she has a pet turtle instead.",
    "Melanie is going swimming with the kids after the conversation.",
    "Caroline is planning to study counseling to support people like her.",
    "Jon's dance studio opened in June and already has thirty students.",
    "Gina and Jon met at a networking event for small business owners.",
};

/* Appends LoCoMo observations from dir to texts (up to cap); returns count. */
static int load_locomo(const char *dir, char **texts, int cap) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    char *names[64];
    int nn = 0;
    while ((de = readdir(d)) && nn < 64) {
        size_t l = strlen(de->d_name);
        if (l > 5 && strcmp(de->d_name + l - 5, ".json") == 0) names[nn++] = strdup(de->d_name);
    }
    closedir(d);
    /* Sorted, so every run reads the same texts. */
    for (int i = 0; i < nn; i++)
        for (int j = i + 1; j < nn; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    for (int f = 0; f < nn; f++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        free(names[f]);
        FILE *fp = fopen(path, "rb");
        if (!fp) continue;
        fseek(fp, 0, SEEK_END);
        long sz = ftell(fp);
        rewind(fp);
        char *buf = malloc((size_t)sz + 1);
        size_t r = buf ? fread(buf, 1, (size_t)sz, fp) : 0;
        fclose(fp);
        if (!buf) continue;
        buf[r] = 0;
        cJSON *root = cJSON_Parse(buf);
        free(buf);
        for (cJSON *s = root ? root->child : NULL; s && n < cap; s = s->next) {
            size_t l = strlen(s->string);
            if (strncmp(s->string, "session_", 8) || l < 12 ||
                strcmp(s->string + l - 12, "_observation"))
                continue;
            for (cJSON *sp = s->child; sp && n < cap; sp = sp->next)
                for (cJSON *it = sp->child; it && n < cap; it = it->next)
                    if (cJSON_IsString(cJSON_GetArrayItem(it, 0)))
                        texts[n++] = strdup(cJSON_GetArrayItem(it, 0)->valuestring);
        }
        cJSON_Delete(root);
    }
    return n;
}

int main(int argc, char **argv) {
    const char *model_dir = "models/all-MiniLM-L6-v2", *locomo = "../shared/data/locomo";
    int threads = 2, reps = 5, n_texts = 256;
    char batches_arg[128] = "1,8,32";
    int c;
    while ((c = getopt(argc, argv, "m:d:t:r:n:b:h")) != -1) {
        switch (c) {
        case 'm': model_dir = optarg; break;
        case 'd': locomo = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'n': n_texts = atoi(optarg); break;
        case 'b': snprintf(batches_arg, sizeof batches_arg, "%s", optarg); break;
        default:
            fprintf(stderr,
                    "usage: bench_embed [-m MODEL_DIR] [-d LOCOMO_DIR] [-t THREADS] [-r REPS] "
                    "[-n TEXTS] [-b B,B,...]\n");
            return c == 'h' ? 0 : 1;
        }
    }
    if (reps < 1 || threads < 1 || n_texts < 1) {
        fprintf(stderr, "error: -t, -r and -n must be positive\n");
        return 1;
    }
    embedder *e;
    if (embedder_load(model_dir, &e) != IS_OK) {
        fprintf(stderr, "error: %s (run scripts/fetch_embedder.sh)\n", is_error_last());
        return 1;
    }
    embedder_set_n_threads(e, threads);

    char **texts = calloc((size_t)n_texts, sizeof *texts);
    int n = load_locomo(locomo, texts, n_texts);
    const char *source = n ? "LoCoMo observations" : "built-in facts";
    for (int i = n; i < n_texts; i++)
        texts[i] = strdup(builtin[i % (sizeof builtin / sizeof *builtin)]);
    long total_tokens = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)embedder_max_tokens(e));
    for (int i = 0; i < n_texts; i++) {
        int32_t k;
        wordpiece_encode(embedder_tokenizer(e), texts[i], strlen(texts[i]), embedder_max_tokens(e),
                         ids, &k);
        total_tokens += k;
    }
    free(ids);
    float *out = malloc(sizeof(float) * (size_t)n_texts * (size_t)embedder_dim(e));
    double *t = malloc(sizeof(double) * (size_t)reps);

    printf("bench_embed: %s, %d texts (%s, %.1f tokens each on average), %d thread(s), median of "
           "%d runs\n",
           model_dir, n_texts, source, (double)total_tokens / n_texts, threads, reps);
    printf("| batch | embeddings/s | ms per call | tokens/s |\n|---|---|---|---|\n");
    char *save = NULL;
    for (char *tok = strtok_r(batches_arg, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int bs = atoi(tok);
        if (bs < 1) continue;
        for (int r = -1; r < reps; r++) {
            double t0 = now_s();
            for (int i = 0; i < n_texts; i += bs) {
                int m = n_texts - i < bs ? n_texts - i : bs;
                if (embedder_embed(e, (const char *const *)texts + i, m,
                                   out + (size_t)i * embedder_dim(e)) != IS_OK) {
                    fprintf(stderr, "error: %s\n", is_error_last());
                    return 1;
                }
            }
            if (r >= 0) t[r] = now_s() - t0;
        }
        double med = bench_median(t, reps);
        int calls = (n_texts + bs - 1) / bs;
        printf("| %d | %.1f | %.2f | %.0f |\n", bs, n_texts / med, 1e3 * med / calls,
               total_tokens / med);
        printf("embed,%d,%d,%.1f\n", bs, threads, n_texts / med);
    }
    for (int i = 0; i < n_texts; i++) free(texts[i]);
    free(texts);
    free(out);
    free(t);
    embedder_free(e);
    return 0;
}
