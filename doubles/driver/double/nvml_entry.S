/*
 * Exported entry points of the double's libnvidia-ml.so.1, with the shapes
 * measured on the H100 (driver 580.159.04):
 *
 * - nvmlDeviceGetMemoryInfo(_v2):
 *     55 48 89 e5 41 56 49 89 f6 41 55 49 89 fd
 *     push rbp; mov rbp,rsp; push r14; mov r14,rsi; push r13; mov r13,rdi
 * - nvmlInit_v2: 31 ff e9 <rel32>, xor edi,edi; jmp nvmlInitWithFlags, with
 *   the next exported function (nvmlShutdown) starting right after its 7 bytes.
 * - the others: the libcuda prologue (cuda_entry.S).
 *
 * Each stub undoes its frame and tail-jumps to `impl_<name>` in nvml.c.
 */
        .intel_syntax noprefix

        .section .note.GNU-stack, "", @progbits

        .data
        .p2align 2
.Lguard_word:
        .long 0x321cba00

        .text

/* The libcuda prologue; also defines .Llocal_<name> for jumps that must not
   go through the PLT. */
.macro cu_style_body name
\name:
.Llocal_\name:
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

.macro cu_style name
        .globl \name
        .type \name, @function
        .p2align 4
        cu_style_body \name
.endm

.macro meminfo_style name
        .globl \name
        .type \name, @function
        .p2align 4
\name:
        push rbp
        mov rbp, rsp
        push r14
        mov r14, rsi
        push r13
        mov r13, rdi
        pop r13
        pop r14
        pop rbp
        jmp impl_\name
        .size \name, . - \name
.endm

        cu_style nvmlInitWithFlags

        /* nvmlInit_v2, then nvmlShutdown with no padding in between. */
        .globl nvmlInit_v2
        .type nvmlInit_v2, @function
        .p2align 4
nvmlInit_v2:
        xor edi, edi
        /* jmp rel32, spelled out so the assembler cannot pick the 2-byte form */
        .byte 0xe9
        .long .Llocal_nvmlInitWithFlags - (. + 4)
        .size nvmlInit_v2, . - nvmlInit_v2
        .globl nvmlShutdown
        .type nvmlShutdown, @function
        cu_style_body nvmlShutdown

        meminfo_style nvmlDeviceGetMemoryInfo
        meminfo_style nvmlDeviceGetMemoryInfo_v2

        cu_style nvmlErrorString
        cu_style nvmlDeviceGetCount_v2
        cu_style nvmlDeviceGetHandleByIndex_v2
        cu_style nvmlDeviceGetHandleByUUID
        cu_style nvmlDeviceGetHandleByPciBusId_v2
        cu_style nvmlDeviceGetUUID
        cu_style nvmlDeviceGetIndex
        cu_style nvmlDeviceGetComputeRunningProcesses_v3
