/*
 * Exported entry points of the double's libcuda.so.1.
 *
 * Every one starts with the bytes measured on the H100 (driver 580.159.04):
 *
 *   55                      push rbp
 *   48 89 e5                mov  rbp, rsp
 *   41 54                   push r12
 *   48 83 ec 08             sub  rsp, 8
 *   81 3d <disp32> <imm32>  cmp  dword ptr [rip + disp32], imm32
 *
 * so that an inline hook has to cope with the real shape: 5 bytes end inside
 * `push r12`, and a 14-byte patch has to relocate the RIP-relative cmp. The
 * stub then undoes its frame and tail-jumps to the C implementation
 * `impl_<name>`, leaving the argument registers untouched.
 */
        .intel_syntax noprefix

        .section .note.GNU-stack, "", @progbits

        .data
        .p2align 2
        /* What the real driver's compare reads; the flags are never used. */
.Lguard_word:
        .long 0x321cba00

        .text

.macro cu_stub name
        .globl \name
        .type \name, @function
        .p2align 4
\name:
        push rbp
        mov rbp, rsp
        push r12
        sub rsp, 8
        cmp dword ptr [rip + .Lguard_word], 0x321cba00
        add rsp, 8
        pop r12
        pop rbp
        jmp impl_\name
        .size \name, . - \name
.endm

        /* One line per entry point, shared with the C files and the tests. */
#define CU_ENTRY(name) cu_stub name
#include "cuda_entries.def"
