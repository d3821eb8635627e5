package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

func ev(agg string, seq int64) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{ID: id.String(), Type: "thing.happened", OccurredAt: time.Now().UTC(), AggregateType: "thing",
		AggregateID: agg, Sequence: seq, SchemaVersion: 1, Payload: json.RawMessage(`{}`)}
}

// effects counts side effects in the database, inside the inbox transaction.
const effectsTable = `CREATE TABLE effects (event_id uuid, aggregate_id text, sequence bigint, n serial)`

func countEffects(t testing.TB, db *pgtest.DB, eventID string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM effects WHERE event_id = $1", eventID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func record(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
	_, err := tx.Exec(ctx, "INSERT INTO effects (event_id, aggregate_id, sequence) VALUES ($1, $2, $3)", e.ID, e.AggregateID, e.Sequence)
	return err
}

func newDB(t *testing.T) *pgtest.DB {
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), effectsTable); err != nil {
		t.Fatal(err)
	}
	return db
}

func TestProcessAppliesOnceUnderRepeatedDelivery(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	e := ev("a", 1)
	for i, want := range []inbox.Outcome{inbox.Applied, inbox.Duplicate, inbox.Duplicate} {
		out, err := inbox.Process(ctx, db.Pool, "c1", e, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, e) })
		if err != nil || out != want {
			t.Fatalf("delivery %d: %v, %v; want %v", i+1, out, err, want)
		}
	}
	if n := countEffects(t, db, e.ID); n != 1 {
		t.Fatalf("side effect ran %d times, want 1", n)
	}
	// Another consumer has its own inbox entry.
	if out, _ := inbox.Process(ctx, db.Pool, "c2", e, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, e) }); out != inbox.Applied {
		t.Fatalf("second consumer: %v", out)
	}
}

func TestProcessConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	for round := 0; round < 20; round++ {
		e := ev("a", int64(round+1))
		var applied atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < 2; i++ { // two handler instances get the same event at once
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				out, err := inbox.Process(ctx, db.Pool, "c", e, func(ctx context.Context, tx pgx.Tx) error {
					time.Sleep(5 * time.Millisecond) // hold the claim while the other arrives
					return record(ctx, tx, e)
				})
				if err != nil {
					t.Error(err)
				}
				if out == inbox.Applied {
					applied.Add(1)
				}
			}()
		}
		close(start)
		wg.Wait()
		if applied.Load() != 1 || countEffects(t, db, e.ID) != 1 {
			t.Fatalf("round %d: applied %d times, %d effects", round, applied.Load(), countEffects(t, db, e.ID))
		}
	}
}

func TestProcessErrorRollsBackClaim(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	e := ev("a", 1)
	boom := errors.New("boom")
	_, err := inbox.Process(ctx, db.Pool, "c", e, func(ctx context.Context, tx pgx.Tx) error {
		if err := record(ctx, tx, e); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v", err)
	}
	if countEffects(t, db, e.ID) != 0 {
		t.Fatal("effect survived the rollback")
	}
	out, err := inbox.Process(ctx, db.Pool, "c", e, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, e) })
	if err != nil || out != inbox.Applied || countEffects(t, db, e.ID) != 1 {
		t.Fatalf("retry after failure: %v %v", out, err)
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	for i := 0; i < 12; i++ {
		e := ev("p", int64(i+1))
		if _, err := inbox.Process(ctx, db.Pool, "c", e, func(context.Context, pgx.Tx) error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Pool.Exec(ctx, "UPDATE inbox SET processed_at = now() - interval '40 days' WHERE sequence <= 9"); err != nil {
		t.Fatal(err)
	}
	n, err := inbox.Prune(ctx, db.Pool, inbox.DefaultRetention, 4)
	if err != nil || n != 9 {
		t.Fatalf("Prune = %d, %v; want 9", n, err)
	}
	if _, err := inbox.Prune(ctx, db.Pool, time.Minute, 10); err == nil {
		t.Fatal("retention inside the dedup window accepted")
	}
}
