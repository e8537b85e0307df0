"""Cross-tokenizer alignment: a teacher's scores answered in a student's tokens.

A student with another tokenizer sends its response ids and names its tokenizer (one the
server loaded at start). The front decodes the ids to the response's exact bytes
(`token_bytes`), tokenizes those bytes with the teacher's tokenizer, cuts the response into
chunks at the byte offsets both tokenizations share (`chunks`), scores the teacher's sequence
as an ordinary request, and maps the teacher's rows to the student's (`answer`), top-k ids
through the exact-match vocabulary map of the pair (`vocab_map`). `tokenizers` loads and
describes the student tokenizers and the teachers' (`students`), `request` turns an aligned
request into the teacher's.
"""
