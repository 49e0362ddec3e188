/* Rows of a GGUF tensor as fp32, straight from the file's bytes: an embedding lookup.

   Why: a decode step looks up one token's embedding. Dequantized with numpy (kernels/ggml.py) that
   took about 10 array operations, ~15 us on warm caches but 150-200 us right after a forward has
   swept them, 2-4 % of a batch-1 step of the embedded model. Here it is one call. The values are
   gguf's dequantizer's bit for bit: a Q8_0 weight is its int8 code times the block's fp16 scale,
   both exactly converted to fp32 and multiplied once; F16 and BF16 values are widened exactly. */
#include <stdint.h>
#include <string.h>

enum { F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30 };

/* IEEE half to single, exact for every value (subnormals, infinities, NaN payloads: the compiler's
   _Float16 conversion quiets a signaling NaN, which gguf's numpy conversion keeps) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (!mantissa) {
        bits = sign;
    } else { /* subnormal: shift the mantissa up to its leading one, lowering the exponent */
        uint32_t shift = 0;
        while (!(mantissa & 0x400u)) mantissa <<= 1, shift++;
        bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void q8_0_row(const uint8_t *row, int64_t cols, float *out) {
    for (int64_t at = 0; at < cols / 32; at++) {
        const uint8_t *block = row + at * 34;
        uint16_t scale_bits;
        memcpy(&scale_bits, block, 2);
        const float scale = half_to_float(scale_bits);
        const int8_t *codes = (const int8_t *)(block + 2);
        for (int i = 0; i < 32; i++) out[at * 32 + i] = (float)codes[i] * scale;
    }
}

static void wide_row(int64_t type, const uint8_t *row, int64_t cols, float *out) {
    for (int64_t i = 0; i < cols; i++) {
        uint16_t half;
        if (type == F32) {
            memcpy(out + i, row + 4 * i, 4);
            continue;
        }
        memcpy(&half, row + 2 * i, 2);
        if (type == F16) {
            out[i] = half_to_float(half);
        } else { /* BF16: the upper half of an fp32 */
            const uint32_t bits = (uint32_t)half << 16;
            memcpy(out + i, &bits, 4);
        }
    }
}

/* Whether rb_ggml_rows reads this ggml type (ggml.py's NATIVE_ROW_TYPES) */
static int reads_type(int64_t type) { return type == F32 || type == F16 || type == BF16 || type == Q8_0; }

/* out [n, cols] = rows ids[0..n) of a [rows, cols] tensor of `type` whose rows lie `row_bytes`
   apart from `data`. Returns 0, -1 for a type not read here, -2 for an id outside 0..rows. */
int rb_ggml_rows(int64_t type, const uint8_t *data, int64_t rows, int64_t cols, int64_t row_bytes,
                 const int64_t *ids, int64_t n, float *out) {
    if (!reads_type(type) || (type == Q8_0 && cols % 32)) return -1;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return -2;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = data + ids[r] * row_bytes;
        if (type == Q8_0) q8_0_row(row, cols, out + r * cols);
        else wide_row(type, row, cols, out + r * cols);
    }
    return 0;
}
