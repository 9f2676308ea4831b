#!/usr/bin/env python3
"""make_locomo_eval_golden.py: reference scores for tests/eval/test_locomo_eval.c.

The reference is LoCoMo's own scoring code, task_eval/evaluation.py of the LoCoMo release
(github.com/snap-research/locomo; the committed golden was made with the file of commit 92286325a407,
whose sha256 is recorded in the output), which this script imports from a path you give it; none of
it is copied into this repository. That file imports `bert_score` at the top (for a metric LoCoMo's QA
evaluation does not use); a stub module stands in for it so the file imports without the package.
It needs `regex`, `numpy` and `nltk` (its PorterStemmer, default NLTK_EXTENSIONS mode).

What is recorded (tests/golden/locomo_eval.json), each computed by LoCoMo's functions:
  stem       [word, ps.stem(word)]: words chosen to hit every rule of the stemmer, plus every
             distinct token of the normalised questions and answers of the LoCoMo files in --data-dir
  normalize  [text, normalize_answer(text)]: punctuation, articles, case, commas, whitespace,
             non-ASCII letters and spaces
  pairs      [prediction, gold, exact_match_score, f1_score, f1]: hand pairs, and pairs made from
             the LoCoMo gold answers (an answer against its question, against the next answer,
             against itself with words dropped, reordered or joined by commas)
  questions  one QA file run through eval_question_answering (categories 1-5, the category-3 ';'
             rule, the category-5 'not mentioned' rule, recall of evidence dia_ids against a
             'prediction_context' list): per question its score and recall

Usage: python3 tools/make_locomo_eval_golden.py --locomo-eval PATH/TO/task_eval/evaluation.py \
           [--data-dir ../shared/data/locomo] [--out tests/golden/locomo_eval.json]
"""
import argparse
import glob
import importlib.util
import json
import os
import random
import sys
import tempfile
import types


def load_reference(path):
    stub = types.ModuleType("bert_score")

    def score(*a, **k):
        raise RuntimeError("bert_score is not used by the QA evaluation")

    stub.score = score
    sys.modules["bert_score"] = stub
    spec = importlib.util.spec_from_file_location("locomo_evaluation", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Words exercising each step of the Porter stemmer and NLTK's extensions to it.
STEM_WORDS = """
a an is as be by we i y yy ay by sky skies dying lying tying news innings inning outings outing
cannings canning howe proceed exceed succeed caresses ponies ties dies cats caress feed agreed
plastered bled motoring sing conflated troubled sized hopping tanned falling hissing fizzed failing
filing happy enjoy spy fly try relational conditional rational valenci hesitanci digitizer
conformabli radicalli differentli vileli analogousli vietnamization predication operator feudalism
decisiveness hopefulness callousness formaliti sensitiviti sensibiliti triplicate formative
formalize electriciti electrical hopeful goodness revival allowance inference airliner gyroscopic
adjustable defensible irritant replacement adjustment dependent adoption homologou communism
activate angulariti homologous effective bowdlerize probate rate cease controll roll generalizations
oscillators dying played playing happily beautifully hopefully fully archaeology analogies
logically biology ied cried died tied spied flies tries studies studying studied running runs ran
swimming swam painting paintings painted adoption adopted adopting agencies children
mother's caroline's melanie's pottery camping hiking researching conference transgender lgbtq
yyyyyy eeee oed ing ed s ss sses ies eed ational tional alli logi fulli bli abli
x*d ab*ded ab*dded abl*ded
naïve café résumé über straße ΟΔΟΣ
""".split()


HAND_NORMALIZE = [
    "The cat, and the hat!",
    "A an THE and, Andy's band",
    "  multiple   spaces\tand\nnewlines  ",
    "punctuation: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ gone",
    "Caroline\u2019s \u201cquoted\u201d text",
    "an-a the_a a1 a_b the.",
    "\u00c9T\u00c9 \u00e0 la plage",
    "non\u00a0breaking\u2003space\u3000ideographic",
    "\u0130stanbul",
    "\u039f\u0394\u039f\u03a3 \u03a3\u039f\u03a6\u0399\u0391",
    "",
    ",,,",
    "7 May 2023",
    "the",
]

HAND_PAIRS = [
    ("Caroline researched adoption agencies", "Adoption agencies"),
    ("adoption agencies", "Adoption agencies"),
    ("agencies adoption", "Adoption agencies"),
    ("The adoption agency", "adoption agencies"),
    ("7 May 2023", "7 May 2023"),
    ("May 7, 2023", "7 May 2023"),
    ("on the 7th of May", "7 May 2023"),
    ("", "anything"),
    ("something", ""),
    ("", ""),
    ("the a an", "and"),
    ("pottery, camping, painting", "Pottery, camping, painting, swimming"),
    ("painting, pottery", "Pottery, camping, painting, swimming"),
    ("she likes pottery and camping", "Pottery, camping, painting, swimming"),
    ("no", "No"),
    ("yes yes yes", "yes"),
    ("running runs ran", "run"),
    ("Caroline\u2019s mother", "Caroline's mother"),
    ("LGBTQ support group", "LGBTQ support group; a community"),
    ("na\u00efve caf\u00e9", "Naive cafe"),
]


def data_words_and_answers(data_dir, ref):
    words, answers = set(), []
    for path in sorted(glob.glob(os.path.join(data_dir, "*.json"))):
        with open(path) as f:
            conv = json.load(f)
        for q in conv["qa"]:
            ans = q.get("answer", q.get("adversarial_answer", ""))
            ans = str(ans)
            answers.append((q["question"], ans, q["category"]))
            for t in (q["question"], ans):
                words.update(ref.normalize_answer(t).split())
    return sorted(words), answers


def make_pairs(ref, answers, rnd):
    pairs = list(HAND_PAIRS)
    picked = answers[:: max(1, len(answers) // 150)][:150]
    for i, (question, ans, _) in enumerate(picked):
        nxt = picked[(i + 1) % len(picked)][1]
        toks = ans.split()
        dropped = " ".join(t for t in toks if rnd.random() < 0.6) or ans
        shuffled = toks[:]
        rnd.shuffle(shuffled)
        pairs.append((question, ans))
        pairs.append((nxt, ans))
        pairs.append((dropped, ans))
        pairs.append((" ".join(shuffled), ans))
        pairs.append((", ".join(shuffled[:3]), ans))
    out = []
    for p, g in pairs:
        out.append([p, g, bool(ref.exact_match_score(p, g)), float(ref.f1_score(p, g)), float(ref.f1(p, g))])
    return out


def make_questions(ref, rnd):
    qa = [
        {"category": 1, "answer": "Pottery, camping, painting", "prediction": "painting and pottery",
         "evidence": ["D1:3", "D2:5", "D7:1"], "prediction_context": ["D2:5", "D1:3", "D9:9"]},
        {"category": 1, "answer": "Sweden", "prediction": "Sweden, Norway",
         "evidence": ["D1:1"], "prediction_context": ["D4:4"]},
        {"category": 2, "answer": "7 May 2023", "prediction": "On 7 May, 2023.",
         "evidence": ["D1:3"], "prediction_context": ["D1:3", "D1:4"]},
        {"category": 2, "answer": 2022, "prediction": "in 2022",
         "evidence": ["D3:1", "D3:2"], "prediction_context": ["D3:2"]},
        {"category": 3, "answer": "Likely no; she prefers the city", "prediction": "No",
         "evidence": ["D5:5"], "prediction_context": ["D5:5"]},
        {"category": 3, "answer": "Yes; since she likes dogs", "prediction": "Yes, since she likes dogs",
         "evidence": [], "prediction_context": ["D5:5"]},
        {"category": 4, "answer": "Adoption agencies", "prediction": "She researched adoption agencies.",
         "evidence": ["D2:8"], "prediction_context": ["D2:1", "D2:2"]},
        {"category": 4, "answer": "a beach trip", "prediction": "",
         "evidence": ["D9:1", "D9:2", "D9:3", "D9:4"], "prediction_context": ["D9:4", "D9:2", "D9:3"]},
        {"category": 5, "answer": "a dog", "prediction": "Not mentioned in the conversation",
         "evidence": ["D1:1"], "prediction_context": ["D1:1"]},
        {"category": 5, "answer": "a dog", "prediction": "No information available.",
         "evidence": [], "prediction_context": ["D1:1"]},
        {"category": 5, "answer": "a dog", "prediction": "a dog",
         "evidence": ["D1:1"], "prediction_context": ["D1:2"]},
        {"category": 5, "answer": "a cat", "prediction": "It is NOT MENTIONED anywhere",
         "evidence": ["D1:1"], "prediction_context": ["D1:2"]},
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"qa": qa}, f)
        path = f.name
    try:
        scores, _, recalls = ref.eval_question_answering(path)
    finally:
        os.unlink(path)
    out = []
    for q, s, r in zip(qa, scores, recalls):
        out.append({"category": q["category"], "answer": str(q["answer"]), "prediction": q["prediction"],
                    "evidence": q["evidence"], "retrieved": q["prediction_context"],
                    "score": float(s), "recall": float(r)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--locomo-eval", required=True, help="LoCoMo's task_eval/evaluation.py")
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "locomo"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "locomo_eval.json"))
    args = ap.parse_args()
    ref = load_reference(args.locomo_eval)
    rnd = random.Random(20240601)
    words, answers = data_words_and_answers(args.data_dir, ref)
    stem_words = list(dict.fromkeys(STEM_WORDS + words))
    with open(args.locomo_eval, "rb") as f:
        ref_sha = __import__("hashlib").sha256(f.read()).hexdigest()
    golden = {
        "reference_file_sha256": ref_sha,
        "source": "LoCoMo task_eval/evaluation.py (normalize_answer, exact_match_score, f1_score, f1, "
                  "eval_question_answering) with nltk %s PorterStemmer" % __import__("nltk").__version__,
        "stem": [[w, ref.ps.stem(w)] for w in stem_words],
        "normalize": [[s, ref.normalize_answer(s)] for s in HAND_NORMALIZE + [a for _, a, _ in answers[:60]]],
        "pairs": make_pairs(ref, answers, rnd),
        "questions": make_questions(ref, rnd),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        # One entry a line: readable, and diffs stay small when the reference changes.
        f.write("{\n")
        keys = list(golden)
        for i, key in enumerate(keys):
            val = golden[key]
            f.write("%s: " % json.dumps(key))
            if isinstance(val, list):
                f.write("[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in val) + "\n]")
            else:
                f.write(json.dumps(val, ensure_ascii=False))
            f.write(",\n" if i + 1 < len(keys) else "\n")
        f.write("}\n")
    print("wrote %s: %d stems, %d normalisations, %d pairs, %d questions" % (
        args.out, len(golden["stem"]), len(golden["normalize"]), len(golden["pairs"]), len(golden["questions"])))


if __name__ == "__main__":
    main()
