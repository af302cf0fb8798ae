"""KFACPreconditioner: the user-facing object that ties capture, factors, assignment and solves together.

Call it between backward and the optimizer's step::

    pre = KFACPreconditioner(model)
    loss.backward(); pre.step(); optimizer.step()

Each ``step()`` (1) averages this step's factor statistics over all ranks into the running
factors (every ``factor_update_freq`` steps), (2) recomputes the decompositions of the factors
this rank owns and shares them with the layer's gradient workers (every ``inv_update_freq``
steps), and (3) replaces every preconditioned layer's gradient by its K-FAC direction, scaled
by the KL clip. Gradients are expected to be the same on every rank already (Horovod's
DistributedOptimizer after ``synchronize()``). docs/kfac.md has the conventions and defaults.

This module orders the work; each part has a module of its own: the settings (kfac.options), the statistics'
exchange (kfac.exchange), the running factors and their update (kfac.factors), the decomposition methods
(kfac.methods), sharing within rank groups (kfac.sharing), the decompositions held and the directions computed
with them (kfac.held), late decompositions (kfac.late), the checkpoint (kfac.checkpoint) and the phase timings
(kfac.timing).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from kfac import solve
from kfac.assignment import WorkAssignment, assign_work, auto_fraction
from kfac.capture import LayerCapture, examples_per_pass
from kfac.checkpoint import KFACState, Sources, factors_of
from kfac.comm import Communicator
from kfac.decompose import Recoveries, Results
from kfac.default_comm import default_communicator
from kfac.exchange import StatisticsExchange
from kfac.factors import RunningFactors
from kfac.held import HeldDecompositions
from kfac.late import LateDecompositions
from kfac.layers import KFACLayer, SkipSpec, find_layers
from kfac.methods import Eigen, FactorJob, Inverse, Newton, tikhonov_gammas_of
from kfac.options import KFACOptions, Schedule
from kfac.options import schedule_value as _value
from kfac.precision import ieee_fp32
from kfac.sharing import Sharing
from kfac.timing import PHASES, PhaseTimer

__all__ = ["PHASES", "KFACPreconditioner"]  # PHASES: the names of ``timings`` (kfac.timing)


class KFACPreconditioner:
    """Distributed K-FAC (Martens & Grosse 2015; KFC for convolutions; KAISA's work layout).

    Args:
        model: the model whose nn.Linear and nn.Conv2d layers are preconditioned.
        factor_update_freq: steps between factor updates (the statistics are only captured then).
        inv_update_freq: steps between eigendecompositions (or inverses) of the factors.
        damping: λ of the solve (G ⊗ A + λI)⁻¹, in the units of the per-example Fisher (docs/kfac.md).
        factor_decay: ξ of the running average F ← ξF + (1−ξ)F_batch.
        kl_clip: scales the step by min(1, sqrt(kl_clip / Σ lr²|v·g|)); None turns clipping off.
        lr: the optimizer's learning rate, used only by the KL clip.
        grad_worker_fraction: KAISA's trade-off, from 1/world (memory-optimal) to 1 (no preconditioned
            gradients to exchange), or "auto": the fraction whose groups make a rank receive the fewest
            elements per step at these update frequencies (kfac.assignment.auto_fraction).
        method: 'eigen' (default: the exact damped solve), 'inverse' (Cholesky inverses, factored Tikhonov
            damping) or 'newton' (the same inverses by Newton–Schulz iteration: matrix products only, for
            GPUs), or an instance of kfac.methods' classes (e.g. ``Newton(tf32=True)``); docs/kfac.md.
        eigen_dtype: dtype of the decompositions, float32 at least (torch.float64 for more accuracy).
        loss_reduction: 'mean' when the loss averages over the batch, 'sum' when it adds up.
        skip_layers: module names, class names or classes to leave to the optimizer.
        colocate_factors: decompose a layer's A and G on the same rank.
        backward_passes_per_step: forward/backward passes per ``step()`` (gradient accumulation, each
            pass's loss divided by their number, as with Horovod's option of the same name).
        grad_scaler: the torch GradScaler of an AMP run; its scale is divided out of G.
        communicator: the collectives to use; by default Horovod's when it is initialised with
            several ranks, else none.
        late_decompositions: compute each inverse update's decompositions in the background and
            use them from the next inverse update on (one period late), so that a GPU's training
            steps overlap them. Off by default: with it a run no longer equals the synchronous one.
        factor_examples: the examples per step, over all ranks and backward passes together, whose
            statistics update the factors (dealt out evenly: rank r's pass j takes the first
            examples of its batch, at least one); None takes them all. The factors are averages, and
            a convolution's A averages over every output position of every example, so a few hundred
            examples estimate it nearly as well as thousands at a fraction of the cost, which is what
            makes updating the factors every step affordable at large batches; dealt over ranks, that
            cost divides as the job grows instead of staying on every rank (docs/kfac.md).
        cpu_eigen_limit: on a GPU, factors with at most this many rows are decomposed on the host's
            worker threads (faster there for small matrices), overlapping the GPU's large ones; 0
            keeps them all on the GPU.
        comm_dtype: the precision decompositions and preconditioned gradients travel in (the larger
            part of K-FAC's bytes); None keeps their own, torch.bfloat16 halves them, and every rank
            then uses the same rounded values (docs/kfac.md has the measured accuracy cost). Factor
            statistics are summed over ranks and stay in the layers' precision.
        factor_comm_dtype: the precision factor statistics are summed over ranks in (the largest part
            of K-FAC's bytes when decompositions are rare or stay on their owner); None keeps the
            layers' own, torch.bfloat16 halves them. The counts travel beside them in the layers'
            precision (one small allreduce more per factor update), so the averages divide by exact counts.
            Needs a communicator that sums bfloat16 (torch.distributed; not Horovod 0.28).
        conv_approximation: how a convolution's output positions enter its factors: 'expand' (KFC, every
            position an example) or 'reduce' (K-FAC-reduce: positions summed per example first, so A's
            statistics cost N·D² instead of N·positions·D²; docs/kfac.md).
        bucket_cap_mb: factor statistics of consecutive layers travel in one allreduce of up to this
            many megabytes, started as soon as backward has reached all of them. Small: above a few hundred
            kilobytes an allreduce's time is mostly its bytes, so a larger bucket saves little latency and only
            starts later, after more of backward (docs/kfac.md, "Distribution"); tiny layers still share one.
        tf32: on CUDA, the factor statistics' float32 products in TF32 with float32 accumulation (the GPU's
            matrix units; each factor within about 1e-3 relative, inside the estimate's own noise), and with
            method 'newton' its first steps too; the solve and the preconditioning stay IEEE float32. Off by
            default (every product IEEE); hpcdl.train turns it on for CUDA runs. No effect on a CPU.
        statistics_dtype: None takes a float32 model's layer inputs and output gradients as they are;
            torch.bfloat16 rounds them to bfloat16 before the statistics' products, which then run on a GPU's
            half-precision matrix units with float32 accumulation (twice TF32's rate, no float32 copies): each
            factor is the exact moment of the rounded inputs (docs/kfac.md has the measured accuracy). On a
            CPU the factors are the same, multiplied in float32, and no faster. Inputs that arrive in half
            precision (autocast) take that path whatever this says.

    ``damping``, ``factor_decay``, ``kl_clip`` and ``lr`` may be callables of the step number.
    """

    def __init__(
        self,
        model: nn.Module,
        factor_update_freq: int = 1,
        inv_update_freq: int = 10,
        damping: Schedule = 0.01,
        factor_decay: Schedule = 0.95,
        kl_clip: Schedule | None = 0.001,
        lr: Schedule = 0.1,
        grad_worker_fraction: float | str = 1.0,
        *,
        method: str | Eigen | Inverse = "eigen",
        eigen_dtype: torch.dtype = torch.float32,
        loss_reduction: str = "mean",
        skip_layers: Sequence[SkipSpec] = (),
        colocate_factors: bool = True,
        backward_passes_per_step: int = 1,
        grad_scaler: Any = None,
        communicator: Communicator | None = None,
        late_decompositions: bool = False,
        factor_examples: int | None = None,
        cpu_eigen_limit: int = 512,
        comm_dtype: torch.dtype | None = None,
        factor_comm_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 0.25,
        conv_approximation: str = "expand",
        tf32: bool = False,
        statistics_dtype: torch.dtype | None = None,
    ) -> None:
        self.options = options = KFACOptions(
            factor_update_freq=factor_update_freq, inv_update_freq=inv_update_freq, damping=damping,
            factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, grad_worker_fraction=grad_worker_fraction,
            method=method, eigen_dtype=eigen_dtype, loss_reduction=loss_reduction, skip_layers=skip_layers,
            colocate_factors=colocate_factors, backward_passes_per_step=backward_passes_per_step,
            late_decompositions=late_decompositions, factor_examples=factor_examples,
            cpu_eigen_limit=cpu_eigen_limit, comm_dtype=comm_dtype, factor_comm_dtype=factor_comm_dtype,
            bucket_cap_mb=bucket_cap_mb, conv_approximation=conv_approximation, tf32=tf32,
            statistics_dtype=statistics_dtype,
        )
        self._method = options.solver
        self.method = self._method.name
        self.grad_scaler = grad_scaler
        self.steps = 0
        self._timer = PhaseTimer(lambda: self.layers[0].device if self.layers else None)
        self.timings = self._timer.seconds  # seconds per phase (kfac.timing.PHASES): the host's unless device_timings
        # Collectives issued, by kind ("kfac.factors", "kfac.decompositions", "kfac.directions"); a share by
        # scatter is two (an alltoall, then an allgather).
        self.collectives: dict[str, int] = defaultdict(int)
        # Decompositions that needed a recovery, by kind (solve.RECOVERIES), on the rank that computed them.
        self.eigen_recoveries: dict[str, int] = {kind: 0 for kind in solve.RECOVERIES}
        self._warned_recovery = False
        self._late = LateDecompositions()
        self._sources = Sources()  # what the decompositions came from: a checkpoint saves it (kfac.checkpoint)
        self._restoring: KFACState | None = None  # loaded, its decompositions recomputed at the next step()

        self.layers: list[KFACLayer] = find_layers(model, options.skip_layers, options.conv_approximation)
        if not self.layers:
            warnings.warn("K-FAC found no nn.Linear or nn.Conv2d layer to precondition", stacklevel=2)
        self.comm = communicator if communicator is not None else default_communicator()
        self._exchange = StatisticsExchange(self.comm, self.layers, options.backward_passes_per_step,
                                            options.bucket_cap_mb, options.factor_comm_dtype, self.collectives)
        self._sharing = Sharing(self.comm.rank, lambda: self.layers[0].device, options.comm_dtype, self.collectives,
                                lambda: self._timer.phase("sharing"))
        self.grad_worker_fraction = self._resolved_fraction()
        self.assignment: WorkAssignment = assign_work(
            [layer.a_dim for layer in self.layers],
            [layer.g_dim for layer in self.layers],
            self.comm.size,
            self.grad_worker_fraction,
            options.colocate_factors,
        )
        # Collective set-up of the rank groups, identical on every rank.
        self._worker_group = self.comm.groups(self.assignment.worker_groups())
        self._receiver_block = self.comm.groups(self.assignment.receiver_blocks())

        n = len(self.layers)
        self._factors = RunningFactors(n)
        self._held = HeldDecompositions(n, self._method)
        passes = options.backward_passes_per_step
        per_example = float(passes) if options.loss_reduction == "mean" else 0.0
        shares = None
        if options.factor_examples is not None:
            shares = examples_per_pass(options.factor_examples, self.comm.rank, self.comm.size, passes)
        self._captures = [
            LayerCapture(layer, self._capturing, per_example, self._collector(index), shares, self._timer.hook,
                         "tf32" if options.tf32 else "ieee", options.statistics_dtype)
            for index, layer in enumerate(self.layers)
        ]

    def _resolved_fraction(self) -> float:
        """grad_worker_fraction as a number: 'auto' is the fraction whose groups receive the fewest elements."""
        fraction = self.options.grad_worker_fraction
        if fraction == "auto":
            return auto_fraction(
                [math.prod(s) for i in range(len(self.layers)) for k in "AG"
                 for s in self._method.wire_shapes(self._factor_size(i, k))],
                sum(layer.a_dim * layer.g_dim for layer in self.layers), self.comm.size, self.options.inv_update_freq)
        return float(fraction)

    # ------------------------------------------------------------------ public API
    def step(self, found_inf: Tensor | None = None) -> None:
        """Precondition the gradients in place (after backward, before the optimizer's step).

        ``found_inf``: a 0-dim tensor on the gradients' device, 1.0 when this step's gradients are
        not finite and the optimizer will skip the step (GradScaler's verdict). The step's factor
        statistics are then left out of the running factors, on the device, without a host read;
        the gradients it writes do not matter (the optimizer skips them). Without it, statistics
        that are not finite are left out all the same.
        """
        step = self.steps
        if self._restoring is not None:
            self._restore_decompositions()
        if step % self.options.factor_update_freq == 0:
            with self._timer.phase("factors"):
                self._update_factors(step, found_inf)
        decomposed, inverse_update = self._held.decomposed, step % self.options.inv_update_freq == 0
        stale = [i for i, a in enumerate(self.a_factors) if a is not None and (inverse_update or not decomposed[i])]
        if stale:
            first = [i for i in stale if not decomposed[i]]
            with self._timer.phase("decompositions"):
                self._update_decompositions(stale, step)
            self._sources.note(stale, first, step, (self.a_factors, self.g_factors), self.options.late_decompositions,
                               inverse_update)
        with self._timer.phase("precondition"), ieee_fp32():
            self._precondition(step)
        self.steps += 1

    @property
    def a_factors(self) -> list[Tensor | None]:
        """Per layer, the running factor A (None until the layer's first usable statistics)."""
        return self._factors.a

    @property
    def g_factors(self) -> list[Tensor | None]:
        """Per layer, the running factor G (None until the layer's first usable statistics)."""
        return self._factors.g

    @property
    def statistics_in_forward(self) -> float:
        """The seconds of ``timings['statistics']`` that ran inside forward (the rest ran in backward)."""
        return self._timer.in_forward

    @property
    def synchronise_timings(self) -> bool:
        """Whether each phase waits for the device, so that its seconds include its kernels (kfac.timing)."""
        return self._timer.synchronise

    @synchronise_timings.setter
    def synchronise_timings(self, value: bool) -> None:
        self._timer.synchronise = value

    @property
    def device_timings(self) -> bool:
        """Whether each phase is timed on the device by CUDA events, without waiting (kfac.timing); its
        seconds reach ``timings`` when :meth:`settle_timings` runs."""
        return self._timer.device_events

    @device_timings.setter
    def device_timings(self, value: bool) -> None:
        self._timer.device_events = value

    def settle_timings(self) -> None:
        """Wait for the device and add the phases timed on it (``device_timings``) to ``timings``."""
        self._timer.settle()

    @property
    def stats(self) -> dict[str, Any]:
        """Counters for logs: decompositions recovered by kind, and factor updates left out (skipped
        or non-finite steps, summed over layers). Reading them waits for the device."""
        skipped = 0 if self._factors.skipped is None else int(self._factors.skipped)
        stats: dict[str, Any] = {"eigen_recoveries": dict(self.eigen_recoveries), "skipped_factor_updates": skipped}
        if isinstance(self._method, Newton):  # warm and cold starts, their steps, Cholesky fallbacks on this rank
            stats["newton"] = dict(self._method.counts)
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What the next step needs (kfac.checkpoint): the running factors, the step count, and the factors the
        installed (and the pending late) decompositions were computed from, so that loading recomputes them bit
        for bit. Any rank's state is complete and loads onto any world size. Local: no collective."""
        held = None
        if self._method.warm_starts:  # recomputed from their factors alone they would differ at its tolerance
            held = {i: pair for i, pair in enumerate(self._held.pairs) if pair is not None}
        return KFACState(self.steps, [layer.name for layer in self.layers], (self.a_factors, self.g_factors),
                         self._sources, self.eigen_recoveries, self._method.name, held).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the decompositions are recomputed from their saved factors at the next
        ``step()`` (a collective every rank reaches)."""
        restoring = KFACState.of(state, self.layers, self._method.name)
        self.a_factors[:], self.g_factors[:] = restoring.factors
        self._restoring = restoring
        self.steps = restoring.steps
        self.eigen_recoveries.update(restoring.eigen_recoveries)
        self._late.discard()  # late decompositions of the old factors are of no use now
        self._held.clear()
        self._sources = Sources()

    def _restore_decompositions(self) -> None:
        """Recompute the loaded decompositions from their saved factors, layers in the groups that computed them
        (so that batched decompositions are batched alike), and restart the late ones that were in flight."""
        assert self._restoring is not None
        restoring, self._restoring = self._restoring, None
        installed, n = restoring.sources.installed, len(self.layers)
        held = restoring.held or {}
        if held:  # saved as they were (a warm-started method's): installed, not recomputed
            self._held.install(list(held), {i: pair for i, pair in held.items()
                                            if self.assignment.is_grad_worker(i, self.comm.rank)})
        factors = factors_of(installed, n)
        for step, group in restoring.calls():  # recoveries were counted when first computed: not again
            layers = [i for i in group if i not in held]  # every rank loaded the same state: the same layers
            if layers:
                self._install(layers, self._compute_owned(layers, _value(self.options.damping, step), factors)[0], {})
            self._sources.installed.update({i: installed[i] for i in group})
        late = restoring.sources.late
        if late:
            step = next(iter(late.values()))[2]
            self._start_late(sorted(late), _value(self.options.damping, step), factors_of(late, n))
            self._sources.late = dict(late)

    def remove_hooks(self) -> None:
        """Detach from the model (its forward and backward no longer feed the factors)."""
        for capture in self._captures:
            capture.remove()

    # ------------------------------------------------------------------ factors
    def _capturing(self) -> bool:
        return self.steps % self.options.factor_update_freq == 0

    def _collector(self, index: int) -> Callable[[LayerCapture], None]:
        """Called when a layer's forward and backward of one pass are both done (inside backward)."""

        def collect(capture: LayerCapture) -> None:
            with self._timer.phase("statistics"):
                self._collect(index, capture)

        return collect

    def _collect(self, index: int, capture: LayerCapture) -> None:
        """Hand one pass's statistics to the exchange (which starts the bucket's allreduce once it is full)."""
        stats = capture.statistics()
        assert stats is not None
        capture.reset()  # a later pass in the same step (gradient accumulation) starts afresh
        self._exchange.add(index, stats)

    def _update_factors(self, step: int, found_inf: Tensor | None) -> None:
        """Sum this step's statistics over the ranks and average them into the running factors (kfac.factors)."""
        if self.comm.size > 1:
            with self._timer.phase("factor_reduction"):
                self._exchange.reduce()
        extra = [self.layers[i].name for i in self._exchange.extra_passes]
        if extra:
            warnings.warn(
                f"K-FAC: {', '.join(extra)} ran more than backward_passes_per_step="
                f"{self.options.backward_passes_per_step} times in one step; the extra passes only count on this rank",
                stacklevel=3,
            )
        summed = self._exchange.take()
        for capture in self._captures:
            capture.new_step()
        self._factors.update(summed, _value(self.options.factor_decay, step), self._loss_scale(), found_inf)

    def _loss_scale(self) -> float | Tensor:
        """The GradScaler's current scale, as the tensor it keeps on the device (no host read)."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        scale = getattr(scaler, "_get_scale_async", None)
        value = scale() if scale is not None else None
        return value if isinstance(value, Tensor) else float(scaler.get_scale())

    # ------------------------------------------------------------------ decompositions
    def _factor_size(self, index: int, kind: str) -> int:
        """n of layer ``index``'s n x n factor ``kind`` ('A' or 'G')."""
        layer = self.layers[index]
        return layer.a_dim if kind == "A" else layer.g_dim

    def _update_decompositions(self, stale: list[int], step: int) -> None:
        """Decompose the stale layers' factors (this rank's share) and share them with the grad workers.

        With ``late_decompositions`` an inverse-update step installs the decompositions started at
        the previous one and starts the next in the background; a layer's first decompositions are
        always computed at once.
        """
        damping = _value(self.options.damping, step)
        factors = (list(self.a_factors), list(self.g_factors))  # this step's factors (updates replace, never mutate)
        if not self.options.late_decompositions:
            self._install(stale, *self._compute_owned(stale, damping, factors))
            return
        first = [i for i in stale if not self._held.decomposed[i]]
        if first:
            self._install(first, *self._compute_owned(first, damping, factors))
        if step % self.options.inv_update_freq == 0:
            taken = self._late.take()
            if taken is not None:
                self._install(*taken)
            later = [i for i in stale if i not in first]
            if later:
                self._start_late(later, damping, factors)

    def _compute_owned(
        self, stale: list[int], damping: float, factors: tuple[list, list]
    ) -> tuple[Results, Recoveries]:
        """This rank's decompositions of the stale layers' factors, and which of them needed a recovery."""
        todo = set(stale)
        owned = [(i, kind) for i, kind in self.assignment.owned_factors(self.comm.rank) if i in todo]
        layers = sorted({i for i, _ in owned})
        pairs = [(factors[0][i], factors[1][i]) for i in layers]
        gammas = dict(zip(layers, tikhonov_gammas_of(pairs, damping), strict=True)) if self._method.needs_gamma else {}
        jobs = []
        for i, kind in owned:
            previous = self._held.pairs[i]
            jobs.append(FactorJob((i, kind), factors[kind == "G"][i], gammas[i][kind == "G"] if gammas else 0.0,
                                  None if previous is None else previous[kind == "G"]))
        dtype = self._decomposition_dtype(owned[0][0]) if owned else self.options.eigen_dtype
        return self._method.decompose(jobs, dtype, self.options.cpu_eigen_limit)

    def _install(self, stale: list[int], results: Results, recoveries: Recoveries) -> None:
        """Record recoveries, gather every owner's decompositions in its worker group, keep the grad workers'."""
        rank = self.comm.rank
        self._record_recoveries(recoveries)
        group = self._worker_group
        if len(group.ranks) > 1:
            self._sharing.decompositions(group, self.assignment, stale, results, self._method, self._factor_size,
                                         self._decomposition_dtype(stale[0]))
        self._held.install(stale, {i: (results[(i, "A")], results[(i, "G")]) for i in stale
                                   if self.assignment.is_grad_worker(i, rank)})

    def _record_recoveries(self, recoveries: Recoveries) -> None:
        for kind in recoveries.values():
            self.eigen_recoveries[kind] += 1
        if recoveries and not self._warned_recovery:
            self._warned_recovery = True
            keys = cast(list[tuple[int, str]], sorted(recoveries))
            names = ", ".join(f"{self.layers[i].name} {side} ({recoveries[(i, side)]})" for i, side in keys)
            where = f"rank {self.comm.rank}: " if self.comm.size > 1 else ""
            warnings.warn(
                f"K-FAC {where}the eigendecomposition of {names} failed to converge (a singular or badly "
                "conditioned factor) and was recovered; training goes on. Counts: pre.stats['eigen_recoveries'] "
                "(this warning is given once)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _start_late(self, stale: list[int], damping: float, factors: tuple[list, list]) -> None:
        """Start this rank's decompositions of ``factors`` in the background (kfac.late)."""
        inputs = [cast(Tensor, side[i]) for side in factors for i in stale]
        self._late.start(stale, lambda: self._compute_owned(stale, damping, factors), self.layers[stale[0]].device,
                         inputs)

    def _decomposition_dtype(self, index: int) -> torch.dtype:
        return torch.promote_types(self.options.eigen_dtype, self.layers[index].dtype)

    # ------------------------------------------------------------------ preconditioning
    def _precondition(self, step: int) -> None:
        rank, damping = self.comm.rank, _value(self.options.damping, step)
        grads: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if not self._held.decomposed[i]:
                continue
            grad = layer.grad_matrix(self._decomposition_dtype(i))
            if grad is None:
                if self.comm.size == 1:
                    continue  # nothing to precondition; with several ranks zeros keep the buffers aligned
                grad = torch.zeros(
                    layer.g_dim, layer.a_dim, dtype=self._decomposition_dtype(i), device=layer.device
                )
            grads[i] = grad
        directions = self._held.directions(grads, damping, lambda i: self.assignment.is_grad_worker(i, rank))
        self._share_directions(grads, directions)

        order = sorted(directions)
        if self.options.kl_clip is not None and order:
            lr = _value(self.options.lr, step)
            # One reduction on the device for all layers, in layer order on every rank (the same sum to
            # the last bit), and the scale applied there too: no host read, the step stays asynchronous.
            dots = torch.stack([torch.dot(directions[i].reshape(-1), grads[i].reshape(-1)) for i in order])
            scale = solve.kl_clip_scale_tensor(dots.sum().abs() * lr**2, _value(self.options.kl_clip, step))
            torch._foreach_mul_([directions[i] for i in order], scale)
        for i in order:
            self.layers[i].set_grad(directions[i])

    def _share_directions(self, grads: dict[int, Tensor], directions: dict[int, Tensor]) -> None:
        """Each layer's grad worker in this receiver block sends its direction to the block (one share)."""
        block = self._receiver_block
        if len(block.ranks) == 1 or not self.layers:
            return
        dtype = next(iter(grads.values())).dtype if grads else self.layers[0].dtype
        self._sharing.directions(block, self.assignment, grads, directions, dtype)

