package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// ClaimRowsReadPerEvent runs the claim query (outbox_claim_heads) under
// EXPLAIN ANALYZE in a transaction it rolls back, and returns how many outbox
// rows the plan read (returned or filtered out, over all loops) per claimed
// event. An efficient claim reads about one row per event however large the
// table and however many events wait behind blocked heads; a value near
// backlog/batch means every claim rescans the backlog. Used by benchmarks and
// `fifobox status --explain`-style diagnostics.
func ClaimRowsReadPerEvent(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, batch int) (float64, error) {
	return claimRowsReadPerEvent(ctx, db, batch)
}

func claimRowsReadPerEvent(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, batch int) (float64, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only diagnosis, always rolled back
	// EXPLAIN cannot see inside a function call: explain the function's body
	// under the function's own settings instead.
	var body string
	var settings []string
	if err := tx.QueryRow(ctx, sqlClaimFunction).Scan(&body, &settings); err != nil {
		return 0, fmt.Errorf("explain claim: read outbox_claim: %w", err)
	}
	for _, kv := range settings {
		name, value, _ := strings.Cut(kv, "=")
		if _, err := tx.Exec(ctx, "SELECT set_config($1, $2, true)", name, value); err != nil {
			return 0, fmt.Errorf("explain claim: apply %s: %w", kv, err)
		}
	}
	var plan []byte
	if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+body, int32(batch), int32(batch), uuid.New(), int64(60000)).Scan(&plan); err != nil {
		return 0, fmt.Errorf("explain claim: %w", err)
	}
	var doc []struct {
		Plan planNode `json:"Plan"`
	}
	if err := json.Unmarshal(plan, &doc); err != nil || len(doc) == 0 {
		return 0, fmt.Errorf("explain claim: parse plan: %v", err)
	}
	claimed := doc[0].Plan.ActualRows // events (and any empty heads) returned
	var read float64
	var walk func(n planNode, top bool)
	walk = func(n planNode, top bool) {
		if n.Relation == "outbox" && !top {
			read += (n.ActualRows + n.RemovedByFilter + n.RemovedByIndex) * max(n.Loops, 1)
		}
		for _, c := range n.Plans {
			walk(c, false)
		}
	}
	walk(doc[0].Plan, true)
	if claimed == 0 {
		return 0, nil
	}
	return read / claimed, nil
}

type planNode struct {
	NodeType        string     `json:"Node Type"`
	Relation        string     `json:"Relation Name"`
	ActualRows      float64    `json:"Actual Rows"`
	Loops           float64    `json:"Actual Loops"`
	RemovedByFilter float64    `json:"Rows Removed by Filter"`
	RemovedByIndex  float64    `json:"Rows Removed by Index Recheck"`
	Plans           []planNode `json:"Plans"`
}
