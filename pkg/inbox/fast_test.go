package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

// A batch of first deliveries goes the fast way (every claim in one
// statement, no savepoint per record). What happens to each record must be
// what the careful way decides: a side effect failing mid-batch is that
// event's failure, counted once and not run again, the records before and
// after it are applied once, in order; a side effect that commits or rolls
// back the inbox transaction itself loses no later event's side effect; an
// event id in upper case is claimed and recognised.
func TestEngineFastWayKeepsEveryRecordsOutcome(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// runs counts side effect calls per event id.
	type runs struct {
		mu sync.Mutex
		n  map[string]int
	}
	count := func(r *runs, id string) int {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.n[id]++
		return r.n[id]
	}

	t.Run("a failure mid-batch", func(t *testing.T) {
		t.Parallel()
		db := newDB(t)
		fb := &fakeBroker{}
		a1, b1, c1, d1, a2 := ev("A", 1), ev("B", 1), ev("C", 1), ev("D", 1), ev("A", 2)
		r := &runs{n: map[string]int{}}
		e := newEngine(t, db.Pool, func(ctx context.Context, tx pgx.Tx, x envelope.Envelope) error {
			count(r, x.ID)
			if err := record(ctx, tx, x); err != nil {
				return err
			}
			if x.ID == c1.ID {
				return errors.New("downstream busy") // after its write: it must not stay
			}
			return nil
		}, inbox.EngineConfig{MaxRetries: 2, Lanes: 1})
		recs := []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "b1", b1), recordOf(t, "c1", c1), recordOf(t, "d1", d1), recordOf(t, "a2", a2)}
		if err := e.Handle(ctx, fb, recs); err != nil {
			t.Fatal(err)
		}
		if got, want := summary(fb.taken()), "ack a1; ack b1; retry c1 n=1 failures=1; ack d1; ack a2"; got != want {
			t.Fatalf("settled %s, want %s", got, want)
		}
		if n := r.n[c1.ID]; n != 1 {
			t.Errorf("the failing side effect ran %d times in one delivery, want once", n)
		}
		if got := strings.Join(effectsInOrder(t, db), ","); got != "A/1,B/1,D/1,A/2" {
			t.Errorf("effects %s, want A/1,B/1,D/1,A/2", got)
		}
		if p := parkedRows(t, db); len(p) != 1 || p["C"] != 1 {
			t.Errorf("parks %v, want C with 1 failure", p)
		}
	})

	// ends runs a1, x1, d1 (one group each) with a side effect that ends
	// the transaction in x1's first run, by end.
	ends := func(t *testing.T, end func(ctx context.Context, tx pgx.Tx) error) (string, string) {
		db := newDB(t)
		fb := &fakeBroker{}
		a1, x1, d1 := ev("A", 1), ev("X", 1), ev("D", 1)
		r := &runs{n: map[string]int{}}
		e := newEngine(t, db.Pool, func(ctx context.Context, tx pgx.Tx, x envelope.Envelope) error {
			n := count(r, x.ID)
			if err := record(ctx, tx, x); err != nil {
				return err
			}
			if x.ID == x1.ID && n == 1 {
				return end(ctx, tx)
			}
			return nil
		}, inbox.EngineConfig{MaxRetries: 2, Lanes: 1})
		// A deadline far off: a batch whose transaction broke runs again
		// in place.
		hctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := e.Handle(hctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "x1", x1), recordOf(t, "d1", d1)}); err != nil {
			t.Fatal(err)
		}
		return summary(fb.taken()), strings.Join(effectsInOrder(t, db), ",")
	}

	t.Run("a side effect commits through pgx", func(t *testing.T) {
		t.Parallel()
		settled, effects := ends(t, func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) })
		if want := "ack a1; retry x1 n=1 failures=1; ack d1"; settled != want {
			t.Errorf("settled %s, want %s (the commit refused: x1's failure)", settled, want)
		}
		if effects != "A/1,D/1" {
			t.Errorf("effects %s, want A/1,D/1", effects)
		}
	})

	t.Run("a side effect commits in SQL", func(t *testing.T) {
		t.Parallel()
		settled, effects := ends(t, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "COMMIT")
			return err
		})
		// The COMMIT made a1 and x1 applied, and the claim of d1 (made
		// for the whole batch) too: it must not make d1 a duplicate.
		if want := "ack a1; ack x1; ack d1"; settled != want {
			t.Errorf("settled %s, want %s", settled, want)
		}
		if effects != "A/1,X/1,D/1" {
			t.Errorf("effects %s, want A/1,X/1,D/1", effects)
		}
	})

	t.Run("an event id in upper case", func(t *testing.T) {
		t.Parallel()
		db := newDB(t)
		fb := &fakeBroker{}
		a1, a2 := ev("A", 1), ev("A", 2)
		a1.ID = strings.ToUpper(a1.ID)
		e := newEngine(t, db.Pool, record, inbox.EngineConfig{Lanes: 1})
		if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2)}); err != nil {
			t.Fatal(err)
		}
		lower := a1
		lower.ID = strings.ToLower(a1.ID)
		if err := e.Handle(ctx, fb, []*inbox.Record{recordOf(t, "a1-lower", lower), recordOf(t, "a1-again", a1)}); err != nil {
			t.Fatal(err)
		}
		if got, want := summary(fb.taken()), "ack a1; ack a2; ack a1-lower; ack a1-again"; got != want {
			t.Fatalf("settled %s, want %s", got, want)
		}
		if got := strings.Join(effectsInOrder(t, db), ","); got != "A/1,A/2" {
			t.Errorf("effects %s, want A/1,A/2 (the copies are duplicates)", got)
		}
	})
}

// At a Lambda's deadline the fast way deletes the claims of the records it
// did not start. Where the user may not delete from its inbox table, the
// batch is handed back whole (nothing of it applied, nothing counted as a
// failure), and from then on the engine takes batches with a deadline the
// careful way, which applies what it started.
func TestEngineFastWayWithoutDeleteOnTheInboxTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := newDB(t)
	for _, q := range []string{
		`CREATE TABLE own_inbox (event_id uuid PRIMARY KEY)`,
		`GRANT SELECT, INSERT ON own_inbox, effects TO fifobox_consumer`,
		`GRANT USAGE ON SEQUENCE effects_n_seq TO fifobox_consumer`,
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	pool := confinedPool(t, db, "c")
	fb := &fakeBroker{}
	slow := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		time.Sleep(100 * time.Millisecond)
		return record(ctx, tx, e)
	}
	e := newEngine(t, pool, slow, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{DeadlineMargin: 300 * time.Millisecond,
		Inbox: inbox.Table{Name: "own_inbox", EventID: "event_id"}}, Lanes: 1, MaxRetries: 3})
	var recs []*inbox.Record
	for i := int64(1); i <= 10; i++ {
		recs = append(recs, recordOf(t, fmt.Sprint("a", i), ev("A", i)))
	}
	invoke := func(recs []*inbox.Record) (acks int) {
		t.Helper()
		hctx, cancel := context.WithTimeout(ctx, 800*time.Millisecond)
		defer cancel()
		if err := e.Handle(hctx, fb, recs); err != nil {
			t.Fatal(err)
		}
		for _, c := range fb.taken() {
			switch {
			case c.kind == "ack":
				acks++
			case c.kind != "retry" || c.retry.Failures != 0:
				t.Fatalf("unfinished record settled %s", summary([]call{c}))
			}
		}
		return acks
	}
	if acks := invoke(recs); acks != 0 {
		t.Fatalf("%d acks; want the batch handed back whole (its claims could not be deleted)", acks)
	}
	if n := len(effectsInOrder(t, db)); n != 0 {
		t.Fatalf("%d effects committed", n)
	}
	acks := invoke(recs)
	if acks == 0 || acks == len(recs) {
		t.Fatalf("%d acks of %d: want the careful way to apply what it started", acks, len(recs))
	}
	if err := e.Handle(ctx, fb, recs[acks:]); err != nil {
		t.Fatal(err)
	}
	fb.taken()
	effects := effectsInOrder(t, db)
	for i, s := range effects {
		if s != fmt.Sprintf("A/%d", i+1) {
			t.Fatalf("effects out of order or twice: %v", effects)
		}
	}
	if len(effects) != len(recs) {
		t.Fatalf("%d effects, want %d", len(effects), len(recs))
	}
}
