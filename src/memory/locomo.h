/*
 * locomo: reader for LoCoMo conversations (Maharana et al., ACL 2024), the
 * data set of long two-person conversations with memory facts
 * ("observations", each tied to the turn it came from) and questions with
 * gold answers and evidence turns. Used to ingest demo memories, to
 * benchmark with realistic facts and to evaluate answers.
 *
 * File shape (one conversation per file): speaker_a, speaker_b, session_N
 * (turns: speaker, dia_id "D3:7", text, optional blip_caption),
 * session_N_date_time, session_N_observation ({speaker: [[text, dia_id]...]}),
 * qa ([{question, answer | adversarial_answer, evidence: [dia_id], category}]).
 */
#ifndef IS_MEMORY_LOCOMO_H
#define IS_MEMORY_LOCOMO_H

#include "inferscale.h"

typedef struct locomo_turn {
    char *speaker;
    char *dia_id;
    char *text; /* "Speaker: text" (with "[shares <caption>]" for photos) */
    int32_t session;
} locomo_turn;

typedef struct locomo_fact {
    char *speaker; /* whose fact */
    char *text;
    char *dia_id; /* evidence turn */
    int32_t session;
    int32_t turn; /* index of the evidence turn in turns, -1 if it is missing */
    char *date;   /* the session's date as "8 May 2023" (locomo_short_date), "" if undated */
} locomo_fact;

typedef struct locomo_question {
    char *question;
    char *answer;    /* gold answer (adversarial_answer for category 5), "" if none */
    char **evidence; /* dia_ids */
    int32_t n_evidence;
    int32_t category; /* 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial */
} locomo_question;

typedef struct locomo_conv {
    char *name; /* file name without directory and extension */
    char *speaker_a, *speaker_b;
    locomo_turn *turns;
    int32_t n_turns;
    locomo_fact *facts;
    int32_t n_facts;
    locomo_question *questions;
    int32_t n_questions;
} locomo_conv;

/* Reads one conversation file. IS_ERR_IO, IS_ERR_FORMAT (message names what
 * is wrong). */
is_status locomo_load(const char *path, locomo_conv **out);
void locomo_free(locomo_conv *c);

/* LoCoMo's session time "1:56 pm on 8 May, 2023" as the day alone,
 * "8 May 2023" (the form of the gold answers: the time of day is dropped,
 * and so are commas); text without " on " keeps all but its commas.
 * Writes at most cap bytes (NUL included); returns buf. */
char *locomo_short_date(const char *session_time, char *buf, size_t cap);

/* The (up to) w turns before fact f's evidence turn, oldest first, as
 * pointers to their text; returns how many. */
int32_t locomo_fact_context(const locomo_conv *c, const locomo_fact *f, int32_t w,
                            const char **turns);

#endif
