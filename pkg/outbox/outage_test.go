package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// elapse makes the outbox live through d: every head's schedule (backoff,
// lease) and retry streak moves d into the past. Time is scaled this way,
// never the retry policy: the dispatcher runs with the shipped defaults.
func elapse(t *testing.T, db *pgtest.DB, d time.Duration) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(),
		`UPDATE outbox_heads SET due_at = due_at - make_interval(secs => $1), retry_since = retry_since - make_interval(secs => $1)`,
		d.Seconds()); err != nil {
		t.Fatal(err)
	}
}

// A broker outage several times longer than the backoff cap parks nothing
// with the shipped configuration: retryable failures keep retrying (the
// RetryingAggregates gauge says so meanwhile), and once the broker is back
// every aggregate resumes in order. Only an outage longer than RetryFor
// turns events dead.
func TestOutageWithShippedRetryPolicy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		outage   time.Duration
		wantDead bool
	}{
		{"outage 4x the backoff cap", 20 * time.Minute, false},
		{"outage 3 hours", 3 * time.Hour, false},
		{"outage longer than RetryFor", 25 * time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			const aggregates = 50
			for i := 1; i <= 3; i++ {
				var evs []envelope.Envelope
				for a := 0; a < aggregates; a++ {
					evs = append(evs, event(fmt.Sprintf("o-%02d", a), i))
				}
				enqueue(t, db.Pool, evs...)
			}
			var down atomic.Bool
			down.Store(true)
			rec := &outboxtest.Recorder{Fail: func(outbox.Message) error {
				if down.Load() {
					return errors.New("ServiceUnavailable: SNS is down")
				}
				return nil
			}}
			d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{})
			if cfg := d.Config(); cfg.BackoffCap != 5*time.Minute || cfg.RetryFor != 24*time.Hour || cfg.MaxAttempts != 0 {
				t.Fatalf("shipped policy changed (cap %s, retry for %s, max attempts %d): revisit this test", cfg.BackoffCap, cfg.RetryFor, cfg.MaxAttempts)
			}
			// Live through the outage in steps shorter than the backoff cap.
			step := time.Minute
			for lived := time.Duration(0); lived < tc.outage; lived += step {
				if err := d.Drain(ctx); err != nil {
					t.Fatal(err)
				}
				if tc.outage > 2*time.Hour && lived < tc.outage-time.Hour {
					step = 30 * time.Minute // skip ahead; backoff stays capped at 5 minutes
				} else {
					step = time.Minute
				}
				elapse(t, db, step)
			}
			if err := d.Drain(ctx); err != nil {
				t.Fatal(err)
			}
			st, err := outbox.Stats(ctx, db.Pool)
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantDead {
				if st.Dead != aggregates || st.ParkedAggregates != aggregates {
					t.Fatalf("after %s: %+v; want every head dead (retry budget spent)", tc.outage, st)
				}
				return
			}
			if st.Dead != 0 || st.ParkedAggregates != 0 || st.RetryingAggregates != aggregates {
				t.Fatalf("during a %s outage: %+v; want nothing dead or parked, all %d aggregates retrying", tc.outage, st, aggregates)
			}
			down.Store(false)
			elapse(t, db, 5*time.Minute) // the longest backoff
			if err := d.Drain(ctx); err != nil {
				t.Fatal(err)
			}
			want := map[string]int{}
			for a := 0; a < aggregates; a++ {
				want[fmt.Sprintf("o-%02d", a)] = 3
			}
			checkOrder(t, rec.Acks(), want, false)
			if st, _ := outbox.Stats(ctx, db.Pool); st.RetryingAggregates != 0 || st.Pending != 0 {
				t.Fatalf("after recovery: %+v", st)
			}
		})
	}
}

// A batch never outlives its invocation: with every Publish call taking
// 4 s (a publisher honouring its context, and a stuck one that does not),
// Run returns before the deadline, the unpublished rest of each run is
// released unattempted, and nothing stays claimed.
func TestSlowBrokerBatchEndsBeforeDeadline(t *testing.T) {
	t.Parallel()
	for _, honoursContext := range []bool{true, false} {
		t.Run(fmt.Sprintf("publisher-honours-context=%v", honoursContext), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			var evs []envelope.Envelope
			for i := 1; i <= 20; i++ {
				for a := 0; a < 30; a++ {
					evs = append(evs, event(fmt.Sprintf("s-%02d", a), i))
				}
			}
			enqueue(t, db.Pool, evs...)
			slow := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
				errs := make([]error, len(msgs))
				took := time.After(4 * time.Second)
				if !honoursContext {
					<-took // a stuck client: 4 s whatever its deadline
					return errs
				}
				select {
				case <-took:
				case <-ctx.Done():
					for i := range errs {
						errs[i] = ctx.Err()
					}
				}
				return errs
			})
			// The first call's 4 s fit before the stop point; the next
			// wave's do not.
			d := newDispatcher(t, db.Pool, slow, outbox.DispatcherConfig{RunBudget: time.Hour, MaxRun: 20, BatchSize: 600})
			ctx, cancel := context.WithTimeout(context.Background(), 9*time.Second)
			defer cancel()
			deadline, _ := ctx.Deadline()
			if err := d.Run(ctx); err != nil {
				t.Fatal(err)
			}
			if late := time.Since(deadline); late > 0 {
				t.Fatalf("Run returned %s after its deadline", late)
			}
			tot := d.Totals()
			t.Logf("claimed %d, sent %d, retried %d, released %d", tot.Claimed, tot.Sent, tot.Retried, tot.Released)
			if tot.Released == 0 {
				t.Fatal("nothing released: the batch was not cut at its time limit")
			}
			if n := headCount(t, db.Pool, "claim_token IS NOT NULL"); n != 0 {
				t.Fatalf("%d aggregates left claimed", n)
			}
			if n := count(t, db.Pool, "state = 'pending' AND attempts > 0"); int64(n) != tot.Retried {
				t.Fatalf("%d pending events were attempted, want only the %d retried ones (released events stay unattempted)", n, tot.Retried)
			}
		})
	}
}

// A deep backlog of one aggregate drains in runs, not one event per cycle.
func TestDeepAggregateDrainsInRuns(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const n = 3000
	var evs []envelope.Envelope
	for i := 1; i <= n; i++ {
		evs = append(evs, event("deep", i))
	}
	enqueue(t, db.Pool, evs...)
	rec := &outboxtest.Recorder{}
	var batches atomic.Int64
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 500, OnBatch: func(outbox.BatchResult) { batches.Add(1) }})
	if err := d.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	checkOrder(t, rec.Acks(), map[string]int{"deep": n}, false)
	// Runs start at RunBudget / 10 ms = 10 events and grow once the
	// instant publisher's latency is measured: far fewer than n cycles.
	t.Logf("%d events of one aggregate in %d batches", n, batches.Load())
	if batches.Load() > 100 {
		t.Fatalf("%d batches for %d events of one aggregate: runs did not grow", batches.Load(), n)
	}
}
