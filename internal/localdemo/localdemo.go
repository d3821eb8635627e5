// Package localdemo runs the whole fifobox pipeline on one machine with the
// real function handlers: a demo producer writes orders and their events in
// one transaction each; a local scheduler invokes the dispatcher Lambda's
// handler the way EventBridge Scheduler does (overlapping invocations with
// deadlines); each consumer runs as the transport's runner (for SNS/SQS, a
// local event-source runner per SQS FIFO queue feeding the consumer
// Lambda's handler) applying the read model through the inbox. An observer
// around each consumer's side effect checks that every aggregate's events
// arrive in order. It prints a live progress line and a summary. It knows
// no transport: Deps.Runner and Deps.Dispatch are the transport's.
package localdemo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Config of a demo run.
type Config struct {
	// Orders to create; each makes three events (created, paid, shipped). Default 300.
	Orders int
	// Rate is the target number of business transactions per second. Default 200.
	Rate int
	// SchedulePeriod is how often the local scheduler invokes the dispatcher
	// handler (EventBridge Scheduler: once a minute). Default 10s.
	SchedulePeriod time.Duration
	// InvocationTimeout is each dispatcher invocation's deadline (the Lambda
	// timeout). It exceeds the period so invocations overlap and publishing
	// never pauses. Default SchedulePeriod + 5s.
	InvocationTimeout time.Duration
	// Out receives the progress line and summary.
	Out io.Writer
	// Interactive redraws the progress line in place (a terminal).
	Interactive bool
	// StayUp keeps the dispatcher and the consumers running once the demo
	// has drained, until ctx ends (Ctrl-C): make local's default. Without
	// it Run returns once every event was applied (tests, CI).
	StayUp bool
}

// Deps are the running pieces the demo drives.
type Deps struct {
	Pool *pgxpool.Pool
	// Dispatch is the dispatcher Lambda's handler.
	Dispatch func(ctx context.Context) (dispatcher.Result, error)
	// Published counts events the dispatcher's publisher got acknowledged.
	Published *atomic.Int64
	Log       *slog.Logger

	// Runner returns the named consumer's runner (the transport's
	// Consumer) applying the side effect apply, which the demo wraps to
	// observe each event's order.
	Runner func(consumer string, apply Observed) (transport.Runner, error)
	// Topology names the consumers and what each selects.
	Topology topology.Topology
}

// Observed is a consumer's side effect as the demo wraps it: applied(e)
// runs after e's side effect succeeded, failed(err) after it failed.
type Observed struct {
	Applied func(envelope.Envelope)
	Failed  func(error)
}

// consumers returns each consumer by name.
func (d Deps) consumers() map[string]topology.Consumer {
	out := map[string]topology.Consumer{}
	for _, c := range d.Topology.Consumers {
		out[c.Name] = c
	}
	return out
}

// OrderPayload is the demo's order event payload.
type OrderPayload struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	Status      string `json:"status"`
}

const schema = `CREATE TABLE IF NOT EXISTS demo_orders (
    id text PRIMARY KEY, customer_id text NOT NULL, amount_cents bigint NOT NULL,
    status text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())`

type queueStats struct {
	received   atomic.Int64
	violations atomic.Int64
	repeats    atomic.Int64
	failed     atomic.Int64
	mu         sync.Mutex
	last       map[string]int64
	seen       map[string]bool
	lat        []time.Duration
}

// produced counts the demo's committed business transactions (one event
// each) by step, so the summary's expectations are what was actually
// enqueued, also when Ctrl-C stops the producer early.
type produced struct {
	steps [len(orderSteps)]atomic.Int64
}

// events is how many events were enqueued, every step together.
func (p *produced) events() int64 {
	var n int64
	for i := range p.steps {
		n += p.steps[i].Load()
	}
	return n
}

// orderSteps are the demo's order events, in each order's sequence.
var orderSteps = [...]string{"created", "paid", "shipped"}

type invocations struct {
	mu                             sync.Mutex
	count, errs, overruns          int
	published, retries, dead, lost int64
}

// Run executes the demo until every event was applied by every consumer
// that subscribes to it, or ctx is cancelled (Ctrl-C).
func Run(ctx context.Context, cfg Config, d Deps) error {
	if cfg.Orders <= 0 {
		cfg.Orders = 300
	}
	if cfg.Rate <= 0 {
		cfg.Rate = 200
	}
	if cfg.SchedulePeriod <= 0 {
		cfg.SchedulePeriod = 10 * time.Second
	}
	if cfg.InvocationTimeout <= 0 {
		cfg.InvocationTimeout = cfg.SchedulePeriod + 5*time.Second
	}
	if _, err := d.Pool.Exec(ctx, schema); err != nil {
		return fmt.Errorf("demo schema: %w", err)
	}
	runID := fmt.Sprintf("%x", rand.Uint32())

	// One runner per consumer, each applying through an order observer.
	consumers := d.consumers()
	names := make([]string, 0, len(consumers))
	for n := range consumers {
		names = append(names, n)
	}
	sort.Strings(names)
	stats := map[string]*queueStats{}
	expected := map[string]*atomic.Int64{}
	rctx, stopRunners := context.WithCancel(context.Background())
	defer stopRunners()
	var rwg sync.WaitGroup
	for _, n := range names {
		st := &queueStats{last: map[string]int64{}, seen: map[string]bool{}}
		stats[n] = st
		expected[n] = &atomic.Int64{}
		r, err := d.Runner(n, Observed{
			Applied: func(e envelope.Envelope) {
				st.mu.Lock()
				defer st.mu.Unlock()
				st.record(runID, e)
			},
			Failed: func(error) { st.failed.Add(1) },
		})
		if err != nil {
			return fmt.Errorf("consumer %s: %w", n, err)
		}
		rwg.Add(1)
		go func() { defer rwg.Done(); _ = r.Run(rctx) }()
	}

	// Local scheduler: invokes the dispatcher handler like EventBridge Scheduler.
	inv := &invocations{}
	sctx, stopScheduler := context.WithCancel(context.Background())
	defer stopScheduler()
	var swg sync.WaitGroup
	swg.Add(1)
	go func() {
		defer swg.Done()
		Schedule(sctx, cfg.SchedulePeriod, cfg.InvocationTimeout, func(ctx context.Context) {
			inv.mu.Lock()
			inv.count++
			inv.mu.Unlock()
			res, err := d.Dispatch(ctx)
			inv.mu.Lock()
			defer inv.mu.Unlock()
			if err != nil {
				inv.errs++
				d.Log.Warn("dispatcher invocation failed", "error", err.Error())
			}
			inv.published += res.Published
			inv.retries += res.Retries
			inv.dead += res.Dead
			inv.lost += res.Lost
		}, func(late time.Duration) {
			inv.mu.Lock()
			inv.overruns++
			inv.mu.Unlock()
			d.Log.Error("dispatcher invocation overran its deadline: Lambda would have killed it there (its claimed runs wait out their lease, and the invocation counts as an error)",
				"late_ms", late.Milliseconds())
		})
	}()

	// Producer: orders advance created -> paid -> shipped, interleaved.
	var enqueued produced
	prodDone := make(chan error, 1)
	start := time.Now()
	go func() { prodDone <- produce(ctx, cfg, d, runID, &enqueued, expected) }()

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var prodErr error
	producing := true
	lastPrint := time.Time{}
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-prodDone:
			producing = false
			prodErr = err
			if err != nil {
				break loop
			}
		case <-tick.C:
		}
		if cfg.Interactive || time.Since(lastPrint) > 2*time.Second {
			progress(ctx, cfg, d, runID, names, stats, &enqueued, producing)
			lastPrint = time.Now()
		}
		if !producing && allArrived(names, stats, expected) {
			break
		}
	}
	if producing {
		// Ctrl-C: the producer stops after its current transaction; wait
		// for it, so the summary counts every event it committed.
		prodErr = <-prodDone
	}
	elapsed := time.Since(start)
	progress(context.Background(), cfg, d, runID, names, stats, &enqueued, false)
	fmt.Fprintln(cfg.Out)
	stop := func() {
		stopScheduler()
		swg.Wait()
		stopRunners()
		rwg.Wait()
	}
	stayingUp := cfg.StayUp && ctx.Err() == nil && prodErr == nil
	if !stayingUp {
		// Every invocation returned: the summary's counts are complete.
		stop()
	}
	rm, rmErr := readModel(context.Background(), d.Pool, runID)
	summary(cfg.Out, ctx.Err() != nil, elapsed, names, stats, expected, &enqueued, inv, d.Published.Load(), rm)
	publishErrors(cfg.Out, d.Pool)
	if stayingUp {
		stayUp(ctx, cfg, d, runID, names, stats, &enqueued)
		stop()
	}
	if prodErr != nil && !errors.Is(prodErr, context.Canceled) {
		return prodErr
	}
	if inv.overruns > 0 {
		return fmt.Errorf("%d dispatcher invocations overran their deadline (on AWS: killed mid-batch)", inv.overruns)
	}
	for _, n := range names {
		if stats[n].violations.Load() > 0 {
			return fmt.Errorf("queue %s: %d order violations", n, stats[n].violations.Load())
		}
	}
	if rmErr != nil {
		return rmErr
	}
	// After Ctrl-C, events still in flight may not have reached the read
	// model yet: the next run's consumers apply them (see observe).
	if want := enqueued.want(); ctx.Err() == nil && !cfg.StayUp && rm != want {
		return fmt.Errorf("read model: %d orders, %d shipped, %d events applied; want %d, %d, %d",
			rm.orders, rm.shipped, rm.applied, want.orders, want.shipped, want.applied)
	}
	return nil
}

// stayUp keeps the pipeline running after the demo drained, until ctx
// ends: a line whenever something moved (events written by other tools,
// `fifobox` commands, a redrive), so the operator sees it happen.
func stayUp(ctx context.Context, cfg Config, d Deps, runID string, names []string, stats map[string]*queueStats, enqueued *produced) {
	fmt.Fprintln(cfg.Out, "\nthe pipeline stays up (dispatcher and consumers running): in another terminal, source localstack/env.sh")
	fmt.Fprintln(cfg.Out, "and try go run ./cmd/fifobox status (or dlq list --consumer shipping, ...). Ctrl-C stops it.")
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	last := ""
	for {
		select {
		case <-ctx.Done():
			fmt.Fprintln(cfg.Out, "\nstopped")
			return
		case <-t.C:
		}
		var b strings.Builder
		progress(ctx, Config{Out: &b}, d, runID, names, stats, enqueued, false)
		line := strings.Replace(strings.TrimSpace(b.String()), "draining |", "up |", 1)
		if line != last {
			fmt.Fprintln(cfg.Out, line)
			last = line
		}
	}
}

// publishErrors says why publishing failed, if it did: the dispatcher keeps
// retrying (nothing is lost), and fifobox status groups the errors.
func publishErrors(w io.Writer, db *pgxpool.Pool) {
	texts, err := outbox.ErrorTexts(context.Background(), db, 1)
	if err != nil || len(texts) == 0 {
		return
	}
	e := texts[0]
	what := "aggregates retrying"
	if e.Kind == "dead" {
		what = "events dead"
	}
	fmt.Fprintf(w, "publish errors: %d %s, most often: %s (fifobox status shows them all; retry-now after the fix)\n", e.Count, what, e.Text)
}

// Schedule calls invoke every period, each call with a deadline of timeout,
// as EventBridge Scheduler invokes a Lambda: calls may overlap; the first
// runs at once. Lambda kills an invocation still running at its deadline; a
// goroutine cannot be killed, so a call still running then is reported to
// overrun (with how late it returned) and counts as failed, which is what
// it would be on AWS. It returns when ctx is done and every call has
// returned.
func Schedule(ctx context.Context, period, timeout time.Duration, invoke func(context.Context), overrun func(late time.Duration)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ictx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			deadline, _ := ictx.Deadline()
			invoke(ictx)
			// Judged by the deadline, not by ictx.Err(): a cancelled run
			// (Ctrl-C) that returns promptly is no overrun.
			if late := time.Since(deadline); late > 0 {
				overrun(late)
			}
		}()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// record counts one handled event of this run (st.mu held): in order,
// again, or before an earlier event of its aggregate.
func (st *queueStats) record(runID string, e envelope.Envelope) {
	if !strings.Contains(e.AggregateID, runID) {
		return // not this run's (left over from an interrupted run)
	}
	switch {
	case st.seen[e.ID]:
		st.repeats.Add(1)
	case e.Sequence <= st.last[e.AggregateID]:
		st.violations.Add(1)
	default:
		st.last[e.AggregateID] = e.Sequence
		st.lat = append(st.lat, time.Since(e.OccurredAt))
		st.received.Add(1)
	}
	st.seen[e.ID] = true
}

type readModelCounts struct {
	orders, shipped, applied int
}

// readModel counts this run's rows in the example consumer's read model.
func readModel(ctx context.Context, db *pgxpool.Pool, runID string) (readModelCounts, error) {
	var c readModelCounts
	err := db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'shipped'), coalesce(sum(event_count), 0)
FROM orders_read_model WHERE order_id LIKE $1`, "order-"+runID+"-%").Scan(&c.orders, &c.shipped, &c.applied)
	if err != nil {
		return c, fmt.Errorf("read model: %w", err)
	}
	return c, nil
}

// want is what the read model must hold once every enqueued event is applied.
func (p *produced) want() readModelCounts {
	return readModelCounts{orders: int(p.steps[0].Load()), shipped: int(p.steps[len(orderSteps)-1].Load()), applied: int(p.events())}
}

func produce(ctx context.Context, cfg Config, d Deps, runID string, enqueued *produced, expected map[string]*atomic.Int64) error {
	steps := orderSteps
	// Each order gets its three steps at random later points, so many orders
	// are in flight at once and their events interleave.
	type job struct {
		order int
		step  int
	}
	var jobs []job
	for o := 0; o < cfg.Orders; o++ {
		jobs = append(jobs, job{o, 0})
	}
	interval := time.Second / time.Duration(cfg.Rate)
	next := time.Now()
	for len(jobs) > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		i := rand.IntN(min(len(jobs), 50))
		j := jobs[i]
		jobs = append(jobs[:i], jobs[i+1:]...)
		orderID := fmt.Sprintf("order-%s-%04d", runID, j.order)
		p := OrderPayload{OrderID: orderID, CustomerID: fmt.Sprintf("cust-%03d", j.order%97), AmountCents: int64(1000 + j.order%50*125), Currency: "EUR", Status: steps[j.step]}
		ev, err := envelope.New("order."+steps[j.step], "order", orderID, p)
		if err != nil {
			return err
		}
		ev.TenantID = "demo"
		ev.CorrelationID = orderID
		// Ctrl-C stops the producer between transactions, never inside one:
		// a commit interrupted by cancellation may still have committed,
		// and the summary would then count one event fewer than was enqueued.
		txctx := context.WithoutCancel(ctx)
		err = pgx.BeginFunc(txctx, d.Pool, func(tx pgx.Tx) error {
			if j.step == 0 {
				if _, err := tx.Exec(txctx, `INSERT INTO demo_orders (id, customer_id, amount_cents, status) VALUES ($1, $2, $3, $4)`,
					orderID, p.CustomerID, p.AmountCents, p.Status); err != nil {
					return err
				}
			} else if _, err := tx.Exec(txctx, `UPDATE demo_orders SET status = $2, updated_at = now() WHERE id = $1`, orderID, p.Status); err != nil {
				return err
			}
			return outbox.Enqueue(txctx, tx, ev)
		})
		if err != nil {
			return fmt.Errorf("demo transaction: %w", err)
		}
		enqueued.steps[j.step].Add(1)
		for name, c := range d.consumers() {
			if c.Matches(ev.Attributes()) {
				expected[name].Add(1)
			}
		}
		if j.step+1 < len(steps) {
			// Anywhere among the waiting jobs: paid and shipped events
			// flow from the start, however many orders.
			jobs = slices.Insert(jobs, rand.IntN(len(jobs)+1), job{j.order, j.step + 1})
		}
		next = next.Add(interval)
		if wait := time.Until(next); wait > 0 {
			time.Sleep(wait)
		}
	}
	return nil
}

func allArrived(names []string, stats map[string]*queueStats, expected map[string]*atomic.Int64) bool {
	for _, n := range names {
		if stats[n].received.Load() < expected[n].Load() {
			return false
		}
	}
	return true
}

func progress(ctx context.Context, cfg Config, d Deps, runID string, names []string, stats map[string]*queueStats, enqueued *produced, producing bool) {
	b, err := outbox.Stats(ctx, d.Pool)
	backlog := "?"
	age := "?"
	if err == nil {
		backlog = fmt.Sprint(b.Pending)
		age = b.OldestPendingAge.Round(time.Millisecond).String()
		if b.RetryingAggregates > 0 || b.Dead > 0 {
			// Publishing fails: say so on the line, not only in the logs.
			backlog += fmt.Sprintf(" (%d aggregates retrying, %d dead: fifobox status says why)", b.RetryingAggregates, b.Dead)
		}
	}
	var qs []string
	for _, n := range names {
		qs = append(qs, fmt.Sprintf("%s %d", n, stats[n].received.Load()))
	}
	rm := "?"
	if c, err := readModel(ctx, d.Pool, runID); err == nil {
		rm = fmt.Sprintf("%d orders, %d shipped", c.orders, c.shipped)
	}
	state := "producing"
	if !producing {
		state = "draining"
	}
	line := fmt.Sprintf("%s | enqueued %d | published %d | backlog %s | oldest pending %s | applied: %s | read model: %s",
		state, enqueued.events(), d.Published.Load(), backlog, age, strings.Join(qs, ", "), rm)
	if cfg.Interactive {
		fmt.Fprintf(cfg.Out, "\r\033[K%s", line)
	} else {
		fmt.Fprintln(cfg.Out, line)
	}
}

// summary reports the run; published is what the broker acknowledged (an
// invocation still running has not reported its counts yet).
func summary(w io.Writer, interrupted bool, elapsed time.Duration, names []string, stats map[string]*queueStats, expected map[string]*atomic.Int64, enqueued *produced, inv *invocations, published int64, rm readModelCounts) {
	inv.mu.Lock()
	fmt.Fprintf(w, "\nsummary: %d events in %d transactions over %s\n", enqueued.events(), enqueued.events(), elapsed.Round(time.Millisecond))
	if interrupted {
		fmt.Fprintln(w, "interrupted: expected counts are the events enqueued before the stop; events still in flight stay in the outbox or their queue, and a later make local applies them, once")
	}
	fmt.Fprintf(w, "dispatcher: %d invocations (%d failed, %d overran their deadline), published %d, retried %d, dead %d\n",
		inv.count, inv.errs, inv.overruns, published, inv.retries, inv.dead)
	inv.mu.Unlock()
	fmt.Fprintf(w, "%-20s %9s %9s %11s %11s %8s %12s %12s\n", "consumer", "expected", "applied", "violations", "redelivered", "failed", "p50 latency", "p99 latency")
	for _, n := range names {
		st := stats[n]
		st.mu.Lock()
		lat := append([]time.Duration(nil), st.lat...)
		st.mu.Unlock()
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		p := func(q float64) string {
			if len(lat) == 0 {
				return "-"
			}
			return lat[min(len(lat)-1, int(q*float64(len(lat))))].Round(time.Millisecond).String()
		}
		fmt.Fprintf(w, "%-20s %9d %9d %11d %11d %8d %12s %12s\n", n, expected[n].Load(), st.received.Load(), st.violations.Load(),
			st.repeats.Load(), st.failed.Load(), p(0.5), p(0.99))
	}
	want := enqueued.want()
	fmt.Fprintf(w, "read model (orders-projection): %d orders, %d shipped, %d events applied (want %d, %d, %d: each event once)\n",
		rm.orders, rm.shipped, rm.applied, want.orders, want.shipped, want.applied)
	fmt.Fprintln(w, "latency: event occurred_at (producer) to handled by the consumer. violations: an aggregate's event handled before an earlier one.")
}
