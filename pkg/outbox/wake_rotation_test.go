package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// Truncating drained wake-up slots (migration 00064) never removes a
// wake-up a producer committed. Producers enqueue one event each into an
// aggregate of its own (so a lost wake-up leaves an aggregate with no head
// and no wake-up: stranded), some holding their transaction open across a
// slot change or rolling back; two claims consume wake-ups, falling behind
// now and then (so a slot due for truncation may still hold live ones),
// while a third session truncates as often as it may, and a transaction
// held open all the while keeps vacuum from removing anything (only
// TRUNCATE reclaims). The run spans several 2 s slot periods and at least 3
// truncations. Without the lock, or without the check for live wake-ups
// after it, it loses some.
func TestTruncatedWakeupsLoseNothing(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("runs for 9 s or more")
	}
	db := pgtest.New(t)
	ctx := context.Background()

	// The long transaction: dead wake-ups stay until a TRUNCATE.
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx) //nolint:errcheck // nothing written
	if _, err := holder.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}

	// Producers stop once 9 s have passed and 3 truncations happened (at
	// most 60 s); claims and truncations go on half a second longer.
	start := time.Now()
	var stopAt atomic.Int64
	stopAt.Store(start.Add(time.Minute).UnixNano())
	producing := func() bool { return time.Now().UnixNano() < stopAt.Load() }
	running := func() bool { return time.Now().UnixNano() < stopAt.Load()+int64(500*time.Millisecond) }
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		committed []string
		next      atomic.Int64
		failed    error
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if failed == nil {
			failed = err
		}
	}
	for p := 0; p < 6; p++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(p), 28))
			for producing() {
				agg := fmt.Sprintf("rot-%d", next.Add(1))
				roll := rnd.IntN(400)
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					if err := outbox.Enqueue(ctx, tx, event(agg, 1)); err != nil {
						return err
					}
					switch {
					case roll == 0: // open across a slot change: its slot may be the one to truncate
						time.Sleep(time.Duration(2000+rnd.IntN(2500)) * time.Millisecond)
					case roll < 20:
						return errRolledBack
					case roll < 120:
						time.Sleep(time.Duration(rnd.IntN(30)) * time.Millisecond)
					}
					return nil
				})
				switch {
				case err == errRolledBack:
				case err != nil:
					fail(err)
					return
				default:
					mu.Lock()
					committed = append(committed, agg)
					mu.Unlock()
				}
			}
		}()
	}
	for c := 0; c < 2; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(c), 64))
			for running() {
				if _, err := db.Pool.Exec(ctx, `SELECT outbox_consume_wakeups(50)`); err != nil {
					fail(fmt.Errorf("consume: %w", err))
					return
				}
				// Now and then both fall behind, so a slot due for
				// truncation still holds live wake-ups.
				if rnd.IntN(150) == 0 {
					time.Sleep(1500 * time.Millisecond)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	var truncated, consumedBefore atomic.Int64 // consumedBefore: heads made during the run
	wg.Add(1)
	go func() {
		defer wg.Done()
		for running() {
			var did bool
			if err := db.Pool.QueryRow(ctx, `SELECT outbox_truncate_wakeups()`).Scan(&did); err != nil {
				fail(fmt.Errorf("truncate: %w", err))
				return
			}
			if did && truncated.Add(1) >= 3 && time.Since(start) > 9*time.Second {
				stopAt.CompareAndSwap(start.Add(time.Minute).UnixNano(), time.Now().UnixNano())
			}
			time.Sleep(3 * time.Millisecond)
		}
	}()
	wg.Wait()
	if failed != nil {
		t.Fatal(failed)
	}
	consumedBefore.Store(int64(headCount(t, db.Pool, "true")))
	// What is left is consumed now.
	for {
		var left int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_wakeups`).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			break
		}
		if _, err := db.Pool.Exec(ctx, `SELECT outbox_consume_wakeups(1000)`); err != nil {
			t.Fatal(err)
		}
	}
	if truncated.Load() < 3 || consumedBefore.Load() == 0 {
		t.Fatalf("%d truncations, %d wake-ups consumed during the run: the race was not exercised", truncated.Load(), consumedBefore.Load())
	}
	// Every committed event's aggregate has its head: its wake-up was consumed.
	var missing []string
	rows, err := db.Pool.Query(ctx, `SELECT c FROM unnest($1::text[]) c
		WHERE NOT EXISTS (SELECT 1 FROM outbox_heads h WHERE h.aggregate_type = 'order' AND h.aggregate_id = c)`, committed)
	if err != nil {
		t.Fatal(err)
	}
	if missing, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(missing) > 0 {
		t.Fatalf("%d of %d committed events lost their wake-up (no head, no wake-up): %v", len(missing), len(committed), missing[:min(len(missing), 10)])
	}
	if heads := headCount(t, db.Pool, "true"); heads != len(committed) {
		t.Fatalf("%d heads for %d committed aggregates (rolled-back ones must have none)", heads, len(committed))
	}
	t.Logf("%d events committed, %d truncations", len(committed), truncated.Load())
}

var errRolledBack = fmt.Errorf("rolled back on purpose")

// The dispatcher itself truncates drained wake-up slots as it claims: over
// a few slot periods of steady traffic, some slot's storage is replaced
// (TRUNCATE gives it a new file) and every event is published.
func TestDispatcherTruncatesDrainedWakeupSlots(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	files := func() map[string]uint32 {
		t.Helper()
		rows, err := db.Pool.Query(ctx, `SELECT relname, relfilenode::bigint FROM pg_class
			WHERE oid IN ('outbox_wakeups_0'::regclass, 'outbox_wakeups_1'::regclass, 'outbox_wakeups_2'::regclass)`)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]uint32{}
		for rows.Next() {
			var name string
			var node int64
			if err := rows.Scan(&name, &node); err != nil {
				t.Fatal(err)
			}
			m[name] = uint32(node)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := files()
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{})
	n := 0
	// Three slot periods and a half: each slot is next in line at least
	// once with wake-ups written and consumed in it.
	for end := time.Now().Add(7 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		n++
		enqueue(t, db.Pool, event(fmt.Sprintf("tr-%d", n), 1))
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if got := rec.Len(); got != n {
		t.Fatalf("published %d of %d events", got, n)
	}
	after := files()
	changed := 0
	for name, node := range before {
		if after[name] != node {
			changed++
		}
	}
	if changed == 0 {
		t.Fatalf("no wake-up slot was truncated in 7 s of claims (files before %v, after %v)", before, after)
	}
}
