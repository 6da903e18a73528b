/*
 * What a module image holds for the double (the model is in cuda.c): the
 * globals of a text image's header, the first bytes of an image file, and
 * the .nv.global* sections of a fat binary's cubin for the device's arch.
 */
#include "double_internal.h"

#define MODULE_HEADER "gpushare-double-module globals="

/* N of an image that begins with MODULE_HEADER and N, else 0. Any other
 * image differs from the header within its first bytes, so nothing past
 * them is read. */
unsigned long long image_globals(const void *image) {
    const char *text = image;
    const size_t len = sizeof MODULE_HEADER - 1;
    char *end = NULL;
    unsigned long long n;
    if (strncmp(text, MODULE_HEADER, len) != 0 || text[len] < '0' || text[len] > '9') {
        return 0;
    }
    errno = 0;
    n = strtoull(text + len, &end, 10);
    return errno == 0 ? n : 0;
}

/* The first bytes of the file at path, NUL-terminated: enough for the header. */
CUresult read_image(const char *path, char *buf, size_t size) {
    FILE *f;
    size_t n;
    if (path == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    f = fopen(path, "rb");
    if (f == NULL) {
        return CUDA_ERROR_FILE_NOT_FOUND;
    }
    n = fread(buf, 1, size - 1, f);
    fclose(f);
    buf[n] = '\0';
    return CUDA_SUCCESS;
}

/*
 * Fat binaries, as nvcc 13 writes them (little endian): a 16-byte header
 * {u32 magic, u16 version 1, u16 header size 16, u64 bytes of entries},
 * then entries back to back, each a header of at least 64 bytes {u16 kind,
 * u16 version, u32 header size, u64 payload size, u32 compressed size, u32,
 * u16 minor, u16 major, u32 arch, u32 name offset, u32 name length, u64
 * flags, u64, u64 decompressed size} and its payload. The runtime passes a
 * __fatBinC_Wrapper_t {int magic, int version, data, filename} whose data
 * is the header.
 */
#define FATBIN_MAGIC 0xBA55ED50U
#define FATBIN_WRAPPER_MAGIC 0x466243B1U
#define FATBIN_HEADER_SIZE 16
#define FATBIN_ENTRY_SIZE 64
#define FATBIN_KIND_ELF 2
#define FATBIN_COMPRESSED (0x8000ULL | 0x2000ULL) /* zstd, LZ4 */
#define ELF_HEADER_SIZE 64
#define ELF_SECTION_SIZE 64
#define GLOBALS_SECTION ".nv.global"

static unsigned le16(const unsigned char *p) {
    return (unsigned)p[0] | (unsigned)p[1] << 8;
}

static unsigned long long le32(const unsigned char *p) {
    return (unsigned long long)le16(p) | (unsigned long long)le16(p + 2) << 16;
}

static unsigned long long le64(const unsigned char *p) {
    return le32(p) | le32(p + 4) << 32;
}

/* Whether p begins with the little-endian magic, read a byte at a time so
 * that an image differing in its first byte is read no further. */
static int has_magic(const unsigned char *p, unsigned magic) {
    int i;
    for (i = 0; i < 4; i++) {
        if (p[i] != (unsigned char)(magic >> (8 * i))) {
            return 0;
        }
    }
    return 1;
}

/* The sizes of the sections named .nv.global* (uninitialised globals, and
 * .nv.global.init's initialised ones) of the ELF64 cubin in the len bytes at
 * elf; 0 when it is not one, or anything it points at lies outside them. */
static unsigned long long elf_globals(const unsigned char *elf, unsigned long long len) {
    const size_t prefix = sizeof GLOBALS_SECTION - 1;
    unsigned long long shoff, shentsize, shnum, shstrndx, names, names_size, total = 0, i;
    const unsigned char *sh;
    if (len < ELF_HEADER_SIZE || memcmp(elf, "\177ELF", 4) != 0 || elf[4] != 2 || elf[5] != 1) {
        return 0; /* not ELF64 little endian */
    }
    shoff = le64(elf + 0x28);
    shentsize = le16(elf + 0x3a);
    shnum = le16(elf + 0x3c);
    shstrndx = le16(elf + 0x3e);
    if (shentsize < ELF_SECTION_SIZE || shstrndx >= shnum || shoff > len ||
        shnum * shentsize > len - shoff) {
        return 0;
    }
    sh = elf + shoff + shstrndx * shentsize;
    names = le64(sh + 0x18);
    names_size = le64(sh + 0x20);
    if (names > len || names_size > len - names) {
        return 0;
    }
    for (i = 0; i < shnum; i++) {
        unsigned long long name;
        sh = elf + shoff + i * shentsize;
        name = le32(sh);
        if (name < names_size && names_size - name >= prefix &&
            memcmp(elf + names + name, GLOBALS_SECTION, prefix) == 0) {
            total = add_sat(total, le64(sh + 0x20));
        }
    }
    return total;
}

/*
 * Whether image is a fat binary (or its wrapper). If so, *globals gets the
 * .nv.global* bytes of its first uncompressed ELF entry for DOUBLE_ARCH (0
 * when there is none, or the container is malformed). No byte past the
 * header's count of entry bytes is read.
 */
int fatbin_globals(const void *image, unsigned long long *globals) {
    const unsigned char *fat = image;
    unsigned long long size, pos = 0;
    *globals = 0;
    if (has_magic(fat, FATBIN_WRAPPER_MAGIC)) {
        const void *data;
        memcpy(&data, fat + 8, sizeof data);
        fat = data;
        if (fat == NULL || !has_magic(fat, FATBIN_MAGIC)) {
            return 1;
        }
    } else if (!has_magic(fat, FATBIN_MAGIC)) {
        return 0;
    }
    if (le16(fat + 4) != 1 || le16(fat + 6) != FATBIN_HEADER_SIZE) {
        return 1;
    }
    size = le64(fat + 8);
    fat += FATBIN_HEADER_SIZE;
    while (size - pos >= FATBIN_ENTRY_SIZE) {
        const unsigned char *entry = fat + pos;
        unsigned long long header = le32(entry + 4), payload = le64(entry + 8);
        if (header < FATBIN_ENTRY_SIZE || header > size - pos || payload > size - pos - header) {
            return 1;
        }
        if (le16(entry) == FATBIN_KIND_ELF && le32(entry + 28) == DOUBLE_ARCH &&
            le32(entry + 16) == 0 && (le64(entry + 40) & FATBIN_COMPRESSED) == 0) {
            *globals = elf_globals(entry + header, payload);
            return 1;
        }
        pos += header + payload;
    }
    return 1;
}
