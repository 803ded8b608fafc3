/* The CPU decode's products over one TriZone segment in pages (rdkv.pages): the query's scores against the keys
 * (rdkv_page_scores) and the probabilities' sum over the values (rdkv_page_attend), each reading a page's codes
 * once into a buffer the L1 cache holds and never writing the dequantized keys or values out; rdkv_page_keys
 * writes them, for pre-RoPE keys, which are rotated in torch. Built and loaded by kernels/cpu_dequant.py; where no
 * C compiler is found rdkv/cpu_decode.py reads the page oracle (rdkv.pages.dequantize) instead, and the tests hold
 * the two equal.
 *
 * Codes: code i of byte j is channel j * (8 / bits) + i (quant.pack), so channel c of a row is bits
 * [bits * c, bits * (c + 1)) of it. Scales and zeros are fp16. Work is split over the thread count the caller
 * passes (torch's), and every float of a result is summed in an order that does not depend on that count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef _Float16 half;

/* Element i of a 16-bit row: fp16, or bf16 (the 16-bit dtype of a bf16 model's cache). */
static inline float x16(const void *x, int64_t i, int bf16) {
    if (!bf16) return (float)((const half *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Rows of one class run into float rows of D channels with channel 2j + i at column i * D/2 + j (the order
 * rdkv.cpu_decode's product undoes; a byte's codes land in both halves, so each half is written in order), scale
 * and zero per ``g`` channels. Code i of byte j is channel j * (8 / bits) + i. */
static void v_rows(const void *stored, const half *scale, const half *zero, int bits, int bf16, int64_t rows,
                   int64_t D, int64_t g, float *restrict out) {
    const int64_t h = D / 2, G = D / g;
    for (int64_t r = 0; r < rows; r++) {
        float *restrict lo = out + r * D, *restrict hi = lo + h;
        if (bits == 16) {
            const uint16_t *x = (const uint16_t *)stored + r * D;
            for (int64_t j = 0; j < h; j++) {
                lo[j] = x16(x, 2 * j, bf16);
                hi[j] = x16(x, 2 * j + 1, bf16);
            }
            continue;
        }
        const uint8_t *restrict c = (const uint8_t *)stored + r * D * bits / 8;
        for (int64_t k = 0; k < G; k++) {
            const float s = (float)scale[r * G + k], z = (float)zero[r * G + k];
            const int64_t a = k * g / 2, b = (k + 1) * g / 2; /* the group's columns in each half */
            if (bits == 8)
                for (int64_t j = a; j < b; j++) {
                    lo[j] = (float)c[2 * j] * s + z;
                    hi[j] = (float)c[2 * j + 1] * s + z;
                }
            else if (bits == 4)
                for (int64_t j = a; j < b; j++) {
                    lo[j] = (float)(c[j] & 15) * s + z;
                    hi[j] = (float)(c[j] >> 4) * s + z;
                }
            else /* byte j/2 holds channels 2j .. 2j+3 for even j */
                for (int64_t j = a; j < b; j += 2) {
                    const uint8_t x = c[j / 2];
                    lo[j] = (float)(x & 3) * s + z;
                    hi[j] = (float)((x >> 2) & 3) * s + z;
                    lo[j + 1] = (float)((x >> 4) & 3) * s + z;
                    hi[j + 1] = (float)(x >> 6) * s + z;
                }
        }
    }
}

static const int BITS_OF[5] = {0, 2, 4, 8, 16}; /* K widths, by their position in rdkv.quant.WIDTHS */

#define BLOCK 32 /* tokens (or channels) a product keeps in registers */

/* row[t] += sum_c w[c] * k[c * ld + t] for t < len: a block of BLOCK tokens accumulates over every channel in
 * registers before it is stored. */
static void dot_rows(float *restrict row, const float *restrict w, const float *restrict k, int64_t kb, int64_t ld,
                     int64_t len) {
    int64_t t = 0;
    for (; t + BLOCK <= len; t += BLOCK) {
        float acc[BLOCK];
        for (int j = 0; j < BLOCK; j++) acc[j] = row[t + j];
        for (int64_t c = 0; c < kb; c++)
            for (int j = 0; j < BLOCK; j++) acc[j] += w[c] * k[c * ld + t + j];
        for (int j = 0; j < BLOCK; j++) row[t + j] = acc[j];
    }
    for (int64_t c = 0; c < kb; c++)
        for (int64_t u = t; u < len; u++) row[u] += w[c] * k[c * ld + u];
}

/* ---- the page layout (rdkv.pages) ------------------------------------------------------------------------------
 * A segment is one byte buffer of pages; each stream's row of ``st`` (int64, the fields below, built from
 * rdkv.pages.PagePlan by kernels/cpu_dequant.py) gives every offset. A page of stream s and V class c holds up to P
 * tokens: K codes of widths 2, 4, 8 (byte row r of width w: channels r * 8/w + k at bits k * w, one byte per token),
 * 16-bit K rows channel-major, an fp16 scale then zero per packed K channel, V codes [P, D*w/8] then V scales and
 * zeros [P, D/g] each (class 16: 16-bit rows [P, D]). K channels are in the stream's permuted order, widths
 * 0, 2, 4, 8, 16 in turn; width-0 channels are the means ``kmean`` outside the pages. A stream's tokens are its
 * classes in turn, each cut into pages. */
enum { T_CHANS = 0, T_CH0 = 5, T_KOFF = 10, T_KMETA = 14, T_VOFF = 15, T_PAGE0 = 16, T_COUNT = 21, T_PSIZE = 25,
       T_CBASE = 29, T_MEAN0 = 33, T_FIELDS = 34 };

typedef struct { int64_t base, t0, live, c; } page_at;

/* Page ``pg`` of a stream: byte offset, first token among the stream's kept tokens, tokens held, V class. */
static page_at locate(const int64_t *t, int64_t pg, int64_t P) {
    page_at a = {0, 0, 0, 0};
    while (a.c < 3 && pg >= t[T_PAGE0 + a.c + 1]) a.c++;
    const int64_t j = pg - t[T_PAGE0 + a.c];
    for (int u = 0; u < a.c; u++) a.t0 += t[T_COUNT + u];
    a.t0 += j * P;
    a.live = t[T_COUNT + a.c] - j * P < P ? t[T_COUNT + a.c] - j * P : P;
    a.base = t[T_CBASE + a.c] + j * t[T_PSIZE + a.c];
    return a;
}

/* The page's keys of widths 2, 4, 8, 16 into o[c * P + t] (c: permuted channel from the first of width 2), t < live. */
static void page_keys(const uint8_t *pg, const int64_t *t, int64_t P, int64_t live, int bf16, float *restrict o) {
    const int64_t packed = t[T_CHANS + 1] + t[T_CHANS + 2] + t[T_CHANS + 3];
    const half *scale = (const half *)(pg + t[T_KMETA]), *zero = scale + packed;
    int64_t c = 0;
    for (int i = 1; i <= 3; i++) {
        const int bits = BITS_OF[i], per = 8 / bits, m = (1 << bits) - 1;
        const uint8_t *sec = pg + t[T_KOFF + i - 1];
        for (int64_t j = 0; j < t[T_CHANS + i]; j++, c++) {
            const uint8_t *row = sec + j / per * P;
            const int sh = (int)(j % per) * bits;
            const float s = (float)scale[c], z = (float)zero[c];
            for (int64_t u = 0; u < live; u++) o[c * P + u] = (float)((row[u] >> sh) & m) * s + z;
        }
    }
    const void *k16 = pg + t[T_KOFF + 3];
    for (int64_t j = 0; j < t[T_CHANS + 4]; j++, c++)
        for (int64_t u = 0; u < live; u++) o[c * P + u] = x16(k16, j * P + u, bf16);
}

/* The page's positions into pos[t], t < live: the page's last section, int16 or int32. */
static void page_pos(const uint8_t *pg, const int64_t *t, const page_at *a, int64_t P, int pos_bytes, int64_t *pos) {
    const uint8_t *ps = pg + t[T_PSIZE + a->c] - P * pos_bytes;
    for (int64_t u = 0; u < a->live; u++) {
        if (pos_bytes == 2) {
            int16_t x;
            memcpy(&x, ps + 2 * u, 2);
            pos[u] = x;
        } else {
            int32_t x;
            memcpy(&x, ps + 4 * u, 4);
            pos[u] = x;
        }
    }
}

/* scores [S, GL, N] := q [S, GL, D] (each stream's permuted channel order) dotted with every kept key of the
 * segment's pages, stream s's token t at scores[(s * GL + l) * N + t] in storage order; columns past a stream's
 * count are left as they are. A page's keys are dequantized into a buffer the L1 cache holds, then multiplied.
 * pos (or NULL) [S, N] := the tokens' positions. */
int rdkv_page_scores(const uint8_t *buf, const int64_t *st, const half *kmean, int bf16, int64_t S, int64_t P,
                     int64_t D, const float *q, int64_t GL, int64_t N, float *scores, int pos_bytes, int64_t *pos,
                     int threads) {
    int64_t most = 0;
    int failed = 0;
    for (int64_t s = 0; s < S; s++) most = st[s * T_FIELDS + T_PAGE0 + 4] > most ? st[s * T_FIELDS + T_PAGE0 + 4] : most;
#pragma omp parallel num_threads(threads)
    {
        float *tile = malloc((size_t)(D * P) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 4) /* pages hold disjoint tokens */
        for (int64_t s = 0; s < S; s++)
            for (int64_t pg = 0; pg < most; pg++) {
                const int64_t *t = st + s * T_FIELDS;
                if (pg >= t[T_PAGE0 + 4] || !tile) continue;
                const page_at a = locate(t, pg, P);
                const int64_t c0 = t[T_CHANS], kept = D - c0; /* channels of width 0, the rest */
                page_keys(buf + a.base, t, P, a.live, bf16, tile);
                if (pos) page_pos(buf + a.base, t, &a, P, pos_bytes, pos + s * N + a.t0);
                for (int64_t l = 0; l < GL; l++) {
                    const float *ql = q + (s * GL + l) * D;
                    float *row = scores + (s * GL + l) * N + a.t0, w = 0.0f;
                    for (int64_t c = 0; c < c0; c++) w += ql[c] * (float)kmean[t[T_MEAN0] + c];
                    for (int64_t u = 0; u < a.live; u++) row[u] = w;
                    dot_rows(row, ql + c0, tile, kept, P, a.live);
                }
            }
        free(tile);
    }
    return failed;
}

/* out [S, D, N] := the keys of every stream, channel-major in its permuted channel order, its positions into
 * pos [S, N] (int64); zero past a stream's count. For pre-RoPE keys, which are rotated in torch. */
int rdkv_page_keys(const uint8_t *buf, const int64_t *st, const half *kmean, int bf16, int64_t S, int64_t P,
                   int64_t D, int64_t N, int pos_bytes, float *out, int64_t *pos, int threads) {
    int failed = 0;
    memset(out, 0, (size_t)(S * D * N) * sizeof(float));
    memset(pos, 0, (size_t)(S * N) * sizeof(int64_t));
#pragma omp parallel num_threads(threads)
    {
        float *tile = malloc((size_t)(D * P) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < S; s++) {
            const int64_t *t = st + s * T_FIELDS, c0 = t[T_CHANS];
            for (int64_t pg = 0; pg < t[T_PAGE0 + 4] && tile; pg++) {
                const page_at a = locate(t, pg, P);
                page_keys(buf + a.base, t, P, a.live, bf16, tile);
                float *o = out + s * D * N + a.t0;
                for (int64_t c = 0; c < c0; c++)
                    for (int64_t u = 0; u < a.live; u++) o[c * N + u] = (float)kmean[t[T_MEAN0] + c];
                for (int64_t c = c0; c < D; c++) memcpy(o + c * N, tile + (c - c0) * P, (size_t)a.live * sizeof(float));
                page_pos(buf + a.base, t, &a, P, pos_bytes, pos + s * N + a.t0);
            }
        }
        free(tile);
    }
    return failed;
}

#define CHUNK_PAGES 16 /* pages of one work item of rdkv_page_attend, summed into its own partial */

/* out [S, GL, D] (channel 2j + i at column i * D/2 + j) += p [S, GL, .] times the values of the segment's pages,
 * p[s, l, t] at p + (s * GL + l) * ldp + t for stream s's token t in storage order. group: V scale group of
 * classes 2, 4, 8. */
int rdkv_page_attend(const uint8_t *buf, const int64_t *st, const int64_t group[3], int bf16, int64_t S, int64_t P,
                     int64_t D, const float *p, int64_t GL, int64_t ldp, float *out, int threads) {
    static const int bits[4] = {2, 4, 8, 16};
    int64_t chunks = 0;
    int failed = 0;
    for (int64_t s = 0; s < S; s++) { /* pages per stream -> work items */
        const int64_t m = (st[s * T_FIELDS + T_PAGE0 + 4] + CHUNK_PAGES - 1) / CHUNK_PAGES;
        chunks = m > chunks ? m : chunks;
    }
    /* one partial per work item (stream, chunk), added in item order after the loop: the same floats on any
     * thread count */
    const int64_t size = GL * D, items = S * chunks;
    float *partial = calloc((size_t)(items * size + 1), sizeof(float));
    if (!partial) return 1;
#pragma omp parallel num_threads(threads)
    {
        float *tile = malloc((size_t)(P * D) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t s = item / chunks, *t = st + s * T_FIELDS, pg0 = item % chunks * CHUNK_PAGES;
            for (int64_t pg = pg0; pg < pg0 + CHUNK_PAGES && pg < t[T_PAGE0 + 4] && tile; pg++) {
                const page_at a = locate(t, pg, P);
                const int w = bits[a.c];
                const int64_t G = w == 16 ? 0 : D / group[a.c], rb = D * w / 8;
                const uint8_t *v = buf + a.base + t[T_VOFF];
                const half *scale = w == 16 ? 0 : (const half *)(v + P * rb);
                v_rows(v, scale, w == 16 ? 0 : scale + P * G, w, bf16, a.live, D, w == 16 ? D : group[a.c], tile);
                for (int64_t l = 0; l < GL; l++) /* BLOCK channels at a time accumulate over the page's rows */
                    for (int64_t d = 0; d < D; d += BLOCK) {
                        const float *pl = p + (s * GL + l) * ldp + a.t0;
                        float *restrict acc = partial + item * size + l * D + d;
                        if (d + BLOCK > D) {
                            for (int64_t r = 0; r < a.live; r++)
                                for (int64_t j = 0; j < D - d; j++) acc[j] += pl[r] * tile[r * D + d + j];
                            continue;
                        }
                        float sum[BLOCK];
                        for (int j = 0; j < BLOCK; j++) sum[j] = acc[j];
                        for (int64_t r = 0; r < a.live; r++)
                            for (int j = 0; j < BLOCK; j++) sum[j] += pl[r] * tile[r * D + d + j];
                        for (int j = 0; j < BLOCK; j++) acc[j] = sum[j];
                    }
            }
        }
        free(tile);
    }
    for (int64_t item = 0; item < items; item++) /* rows are in v_rows's column order, as out is */
        for (int64_t i = 0; i < size; i++) out[item / chunks * size + i] += partial[item * size + i];
    free(partial);
    return failed;
}
