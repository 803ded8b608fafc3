/* Dequantization of one packed TriZone segment on a CPU, in the layouts rdkv.cpu_decode multiplies.
 *
 * One pass per stored tensor, reading the codes once and writing each float once: where torch takes a
 * handful of ops per width (shift, mask, convert, scale, offset, gather), each paying its fixed cost and a
 * pass over the floats. Built and loaded by kernels/cpu_dequant.py; rdkv/cpu_decode.py holds the same
 * computation in torch, used where no C compiler is found, and the tests hold the two equal.
 *
 * Codes: code i of byte j is channel j * (8 / bits) + i (quant.pack). Scales and zeros are fp16.
 */
#include <stdint.h>
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

#define CHUNK 256 /* rows per work item */

/* The values of a segment, out [S, N, D]: stream s's tokens are its class runs in class order (2, 4, 8, 16),
 * zero rows past its count. ``counts`` [S, 4] int64; per class c: codes[c] (the 16-bit rows for class 16),
 * scale[c], zero[c], group[c]; a class without rows may pass NULL; ``bf16``: class 16 rows are bf16, not fp16. */
void rdkv_values(const void *const codes[4], const half *const scale[4], const half *const zero[4],
                 const int64_t group[4], const int64_t *counts, int64_t S, int64_t N, int64_t D, int bf16,
                 float *out, int threads) {
    static const int bits[4] = {2, 4, 8, 16};
    int64_t chunks = 0;
    for (int64_t i = 0; i < S * 4; i++) {
        const int64_t m = (counts[i] + CHUNK - 1) / CHUNK;
        chunks = m > chunks ? m : chunks;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(3) schedule(dynamic, 1) nowait
        for (int64_t s = 0; s < S; s++)
            for (int c = 0; c < 4; c++)
                for (int64_t q = 0; q < chunks; q++) {
                    const int64_t rows = counts[s * 4 + c], r0 = q * CHUNK, r1 = r0 + CHUNK < rows ? r0 + CHUNK : rows;
                    if (r0 >= r1) continue;
                    int64_t before = r0, at = r0; /* stored row in the class tensor, token in the stream */
                    for (int64_t u = 0; u < s; u++) before += counts[u * 4 + c];
                    for (int u = 0; u < c; u++) at += counts[s * 4 + u];
                    const int64_t G = bits[c] == 16 ? 0 : D / group[c];
                    v_rows((const uint8_t *)codes[c] + before * D * bits[c] / 8, bits[c] == 16 ? 0 : scale[c] + before * G,
                           bits[c] == 16 ? 0 : zero[c] + before * G, bits[c], bf16, r1 - r0, D, group[c],
                           out + (s * N + at) * D);
                }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++) {
            const int64_t n = counts[s * 4] + counts[s * 4 + 1] + counts[s * 4 + 2] + counts[s * 4 + 3];
            memset(out + (s * N + n) * D, 0, (size_t)((N - n) * D) * sizeof(float));
        }
    }
}

/* The keys of the (channel block, stream) pairs of one width, out [pairs, kb, N] channel-major: pair p's
 * n[p] rows from stored row row0[p] on (kb channels each, ``bits``-bit codes or fp16 at 16 bits), scale and
 * zero [., kb] per ``kg`` tokens from group group0[p] on; zero past n[p]; ``bf16``: 16-bit rows are bf16. */
void rdkv_keys(const void *codes, const half *scale, const half *zero, int bits, int bf16, int64_t kb, int64_t kg,
               const int64_t *row0, const int64_t *n, const int64_t *group0, int64_t pairs, int64_t N, float *out,
               int threads) {
    const int64_t groups = (N + kg - 1) / kg, rb = bits == 16 ? 2 * kb : kb * bits / 8, m = (1 << bits) - 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t q = 0; q < groups; q++) {
            const int64_t t0 = q * kg, t1 = t0 + kg < N ? t0 + kg : N, live = n[p] < t1 ? n[p] : t1;
            const uint8_t *restrict x = (const uint8_t *)codes + row0[p] * rb; /* the pair's first row */
            for (int64_t c = 0; c < kb; c++) {
                float *restrict o = out + (p * kb + c) * N;
                if (bits == 16) {
                    for (int64_t t = t0; t < live; t++) o[t] = x16(x, t * kb + c, bf16);
                } else if (live > t0) { /* channel c is bits [bits * c, bits * (c + 1)) of its row */
                    const int64_t at = (group0[p] + q) * kb + c, sh = bits * c;
                    const float s = (float)scale[at], z = (float)zero[at];
                    if (rb == 8)
                        for (int64_t t = t0; t < live; t++) {
                            uint64_t r;
                            memcpy(&r, x + t * 8, 8);
                            o[t] = (float)((r >> sh) & m) * s + z;
                        }
                    else if (rb == 4)
                        for (int64_t t = t0; t < live; t++) {
                            uint32_t r;
                            memcpy(&r, x + t * 4, 4);
                            o[t] = (float)((r >> sh) & m) * s + z;
                        }
                    else
                        for (int64_t t = t0; t < live; t++)
                            o[t] = (float)((x[t * rb + sh / 8] >> (sh % 8)) & m) * s + z;
                }
                for (int64_t t = live > t0 ? live : t0; t < t1; t++) o[t] = 0.0f;
            }
        }
}
