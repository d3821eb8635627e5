package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

func TestEnqueueRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := outbox.Enqueue(ctx, tx, event("a", 1), event("a", 2), event("b", 1)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db.Pool, "true"); n != 0 {
		t.Fatalf("after rollback: %d events, want 0", n)
	}
}

func TestEnqueueCommitWritesExactlyTheEventsInOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	first := []envelope.Envelope{event("a", 1), event("b", 1), event("a", 2)}
	second := []envelope.Envelope{event("a", 3), event("c", 1)}
	enqueue(t, db.Pool, first...)
	enqueue(t, db.Pool, second...)

	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, aggregate_seq, body, state FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		id, agg, state string
		seq            int64
		body           []byte
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.id, &x.agg, &x.seq, &x.body, &x.state)
	})
	if err != nil {
		t.Fatal(err)
	}
	all := append(first, second...)
	wantSeq := []int64{1, 1, 2, 3, 1}
	if len(got) != len(all) {
		t.Fatalf("%d rows, want %d", len(got), len(all))
	}
	for i, r := range got {
		if r.id != all[i].ID || r.agg != all[i].AggregateID || r.seq != wantSeq[i] || r.state != "pending" {
			t.Errorf("row %d = %+v, want id %s agg %s seq %d pending", i, r, all[i].ID, all[i].AggregateID, wantSeq[i])
		}
		e, err := envelope.Decode(r.body)
		if err != nil {
			t.Fatalf("row %d body does not decode: %v", i, err)
		}
		if e.Sequence != wantSeq[i] || e.ID != all[i].ID || string(e.Payload) != string(all[i].Payload) {
			t.Errorf("row %d body = %+v", i, e)
		}
	}
}

func TestEnqueueRejectsBadInputAndWritesNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	huge := json.RawMessage(`"` + strings.Repeat("x", 2000) + `"`)
	cases := []struct {
		name   string
		writer outbox.Writer
		edit   func(*envelope.Envelope)
		field  string
		kind   error
	}{
		{"missing id", outbox.Writer{}, func(e *envelope.Envelope) { e.ID = "" }, "id", envelope.ErrMissing},
		{"malformed group id", outbox.Writer{}, func(e *envelope.Envelope) { e.AggregateID = "has space" }, "aggregate_id", envelope.ErrInvalid},
		{"group id too long", outbox.Writer{}, func(e *envelope.Envelope) { e.AggregateID = strings.Repeat("g", 129) }, "aggregate_id", envelope.ErrInvalid},
		{"payload not json", outbox.Writer{}, func(e *envelope.Envelope) { e.Payload = json.RawMessage("{") }, "payload", envelope.ErrInvalid},
		{"too large for configured limit", outbox.Writer{MaxMessageBytes: 1024}, func(e *envelope.Envelope) { e.Payload = huge }, "payload", envelope.ErrTooLarge},
		{"too large for SNS", outbox.Writer{}, func(e *envelope.Envelope) {
			e.Payload = json.RawMessage(`"` + strings.Repeat("x", envelope.DefaultMaxMessageBytes) + `"`)
		}, "payload", envelope.ErrTooLarge},
		{"missing type", outbox.Writer{}, func(e *envelope.Envelope) { e.Type = "" }, "type", envelope.ErrMissing},
		{"bad traceparent", outbox.Writer{}, func(e *envelope.Envelope) { e.TraceParent = "garbage" }, "traceparent", envelope.ErrInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bad := event("agg-bad", 2)
			tc.edit(&bad)
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// The bad event sits between good ones: none of them may be written.
			err = tc.writer.Enqueue(ctx, tx, event("agg-ok", 1), bad, event("agg-ok", 3))
			var ve *envelope.ValidationError
			if !errors.As(err, &ve) || ve.Field != tc.field || !errors.Is(err, tc.kind) {
				t.Fatalf("Enqueue = %v; want field %q kind %v", err, tc.field, tc.kind)
			}
			if !strings.Contains(err.Error(), "event 1") {
				t.Errorf("error %q should name the event index", err)
			}
			// Validation happens before any statement: the caller's tx is still usable.
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("commit after validation error: %v", err)
			}
		})
	}
	if n := count(t, db.Pool, "true"); n != 0 {
		t.Fatalf("%d events written, want 0", n)
	}
	var aggs int
	_ = db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox_aggregates").Scan(&aggs)
	if aggs != 0 {
		t.Fatalf("%d aggregate counters written, want 0", aggs)
	}
}

func TestEnqueueDuplicateIDs(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	e := event("a", 1)
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e, e) })
	var ve *envelope.ValidationError
	if !errors.As(err, &ve) || ve.Field != "id" {
		t.Fatalf("same id twice in one call: %v", err)
	}
	enqueue(t, db.Pool, e)
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) })
	if !errors.Is(err, outbox.ErrDuplicateEvent) {
		t.Fatalf("re-enqueue of an existing id: %v, want ErrDuplicateEvent", err)
	}
	if n := count(t, db.Pool, "true"); n != 1 {
		t.Fatalf("%d events, want 1", n)
	}
}

// Concurrent writers of the same aggregates get gap-free, unique sequences
// and never deadlock (aggregates are locked in sorted order).
func TestEnqueueConcurrentSequences(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const writers, perWriter = 8, 40
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			ctx := context.Background()
			for i := 0; i < perWriter; i++ {
				// Two aggregates per tx, in varying order, to provoke lock-order deadlocks.
				evs := []envelope.Envelope{event("x", i), event("y", i)}
				if (w+i)%2 == 0 {
					evs[0], evs[1] = evs[1], evs[0]
				}
				if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) }); err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, agg := range []string{"x", "y"} {
		var n, distinct, maxSeq int
		err := db.Pool.QueryRow(context.Background(),
			`SELECT count(*), count(DISTINCT aggregate_seq), max(aggregate_seq) FROM outbox WHERE aggregate_id = $1`, agg).Scan(&n, &distinct, &maxSeq)
		if err != nil {
			t.Fatal(err)
		}
		if n != writers*perWriter || distinct != n || maxSeq != n {
			t.Fatalf("aggregate %s: %d rows, %d distinct seqs, max %d; want %d gap-free", agg, n, distinct, maxSeq, writers*perWriter)
		}
	}
}

// Writer.MaxMessageBytes cannot exceed what SNS accepts: a larger event could
// never be published, so it must be refused at enqueue, not parked later.
func TestWriterMaxMessageBytesIsCappedAtTheSNSLimit(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	big := event("big", 1)
	big.Payload = json.RawMessage(`{"blob":"` + strings.Repeat("x", envelope.DefaultMaxMessageBytes) + `"}`)
	for _, w := range []outbox.Writer{{MaxMessageBytes: envelope.DefaultMaxMessageBytes + 1}, {MaxMessageBytes: 10 << 20}} {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.Enqueue(ctx, tx, big) })
		if err == nil || !strings.Contains(err.Error(), "MaxMessageBytes") {
			t.Fatalf("Writer{MaxMessageBytes: %d}: err %v, want one naming MaxMessageBytes", w.MaxMessageBytes, err)
		}
	}
	if n := count(t, db.Pool, "true"); n != 0 {
		t.Fatalf("%d events written", n)
	}
	// The default refuses the event as too large, naming the limit.
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, big) })
	var ve *envelope.ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("default writer: err %v, want a *envelope.ValidationError", err)
	}
}
