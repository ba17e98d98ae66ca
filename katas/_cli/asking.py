"""Answering a clarifying question typed in free text, as the interviewer's notes would.

A stage's ``### Clarifying questions …`` table in INTERVIEWER.md lists what a strong
candidate asks and the answer to give. A learner's own words are matched to a row by
ranking, not by hand-written rules: BM25 (``bm25s``) over each row's question and its
hidden other phrasings (``<!-- also: … -->``), with English stop words dropped and words
stemmed (``snowballstemmer``), so "rejected requests" finds "a denied request". The
answers are left out: their words ("quota", "clock") belong to other rows' questions.
A question no row answers well enough gets the interviewer's stock answer.
``tests/test_interview.py`` measures the matching on phrasings written without seeing
the hidden ones (``tests/interview/asked.toml``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import bm25s
import snowballstemmer

from katas._registry.notes import Question

#: What an interviewer says to a question the notes do not answer.
STOCK_ANSWER = "Your call: state your assumption out loud, and code to it."

#: The lowest score of the best row that counts as a match (below it: the stock answer).
#: The score is BM25's over the square root of the question's word count (a long question
#: needs more words in common than a short one) and over the weight BM25 gives a word
#: that only one row has (so a table of 3 rows and one of 30 share a threshold). Chosen on
#: ``tests/interview/asked.toml``.
MIN_SCORE = 0.26

_STEMMER = snowballstemmer.stemmer("english")


def _words(texts: list[str]) -> list[list[str]]:
    tokens = bm25s.tokenize(
        texts, stopwords="en", stemmer=_STEMMER.stemWords, return_ids=False, show_progress=False
    )
    assert isinstance(tokens, list)
    return tokens


class QuestionMatcher:
    """The rows of one stage's table, ranked for each question asked."""

    def __init__(self, questions: Sequence[Question]) -> None:
        self.questions = list(questions)
        self._index = bm25s.BM25()  # Lucene's BM25: idf = log(1 + (N - df + 0.5) / (df + 0.5))
        self._rare = math.log(1 + (len(self.questions) - 0.5) / 1.5)  # idf at df = 1
        if self.questions:
            documents = [" ".join((q.text, *q.also)) for q in self.questions]
            self._index.index(_words(documents), show_progress=False)

    def match(self, asked: str) -> Question | None:
        """The row that answers ``asked``, or None (the stock answer)."""
        words = _words([asked])[0] if asked.strip() else []
        if not self.questions or not words:
            return None
        scores = self._index.get_scores(words)
        best = int(scores.argmax())
        enough = float(scores[best]) / len(words) ** 0.5 / self._rare >= MIN_SCORE
        return self.questions[best] if enough else None


__all__ = ["MIN_SCORE", "STOCK_ANSWER", "QuestionMatcher"]
