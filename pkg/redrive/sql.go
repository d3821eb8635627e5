package redrive

// All SQL of the redrive package lives here: the audit trail, the
// consumers' held groups and inbox rows (release-holds, dlq discard,
// replay), and the reads behind status, dead-list and prune. The outbox's
// own changes (requeue, discard, retry-now, repair-heads) are pkg/outbox's
// functions, called in the audited transaction. Every statement is
// parameterised.

// The audit trail (redrive_audit, migrations/00004): a row written when an
// operation starts and finished with its outcome; sqlAuditDone finishes it
// inside the operation's own transaction. $1 is the row's id.
const (
	// $1 operation, $2 actor, $3 request id, $4 parameters (JSON), $5 dry run.
	sqlAuditStart = `INSERT INTO redrive_audit (operation, actor, request_id, params, dry_run)
VALUES ($1, $2, NULLIF($3, ''), $4::jsonb, $5) RETURNING id`
	// $2 status, $3 rows affected, $4 error ('' for none).
	sqlAuditFinish = `UPDATE redrive_audit SET status = $2, affected = $3, error = NULLIF($4, ''), finished_at = now() WHERE id = $1`
	// $2 rows affected.
	sqlAuditDone = `UPDATE redrive_audit SET status = 'done', affected = $2, finished_at = now() WHERE id = $1`
	// $1 most rows, newest first.
	sqlListAudit = `SELECT id, operation, actor, coalesce(request_id, ''), params, dry_run, status, affected,
       coalesce(error, ''), started_at, finished_at FROM redrive_audit ORDER BY id DESC LIMIT $1`
)

// A consumer's held groups (inbox_held): $1 consumer, $2 groups (empty: all;
// never NULL, cardinality(NULL) would match nothing).
const (
	sqlCountHeld  = `SELECT count(*), count(DISTINCT group_id) FROM inbox_held WHERE consumer = $1 AND (cardinality($2::text[]) = 0 OR group_id = ANY($2::text[]))`
	sqlDeleteHeld = `DELETE FROM inbox_held WHERE consumer = $1 AND (cardinality($2::text[]) = 0 OR group_id = ANY($2::text[]))`
	// The first $3 rows of each group, in order, and the group's size.
	sqlHeldGroups = `SELECT group_id, message_key, coalesce(sequence, 0), class, held_at, n FROM (
    SELECT group_id, message_key, sequence, class, held_at, position,
           row_number() OVER (PARTITION BY group_id ORDER BY position) AS rn, count(*) OVER (PARTITION BY group_id) AS n
    FROM inbox_held WHERE consumer = $1 AND (cardinality($2::text[]) = 0 OR group_id = ANY($2::text[]))) h
WHERE rn <= $3 ORDER BY group_id, position`
	// Held groups, held messages and parked messages per consumer ($1 empty for all).
	sqlHeldByConsumer = `SELECT consumer, sum(groups)::bigint, sum(msgs)::bigint, sum(parked)::bigint FROM (
    SELECT consumer, count(DISTINCT group_id) AS groups, count(*) AS msgs, 0 AS parked FROM inbox_held
    WHERE $1 = '' OR consumer = $1 GROUP BY consumer
    UNION ALL
    SELECT consumer, 0, 0, count(*) FROM inbox_parked WHERE $1 = '' OR consumer = $1 GROUP BY consumer) c
GROUP BY consumer ORDER BY consumer`
	// dlq discard: the discarded messages' holds ($2 groups, $3 message
	// keys, pairwise), and whole groups ($2).
	sqlReleaseHeldMessages = `DELETE FROM inbox_held h USING unnest($2::text[], $3::text[]) AS d(g, k)
WHERE h.consumer = $1 AND h.group_id = d.g AND h.message_key = d.k`
	sqlReleaseHeldGroups = `DELETE FROM inbox_held WHERE consumer = $1 AND group_id = ANY($2::text[])`
)

// fifobox's inbox: dlq discard marks events handled with outcome
// 'discarded' ($1 consumer; per event $2 id, $3 aggregate type, $4
// aggregate id, $5 sequence); replay forgets a consumer's entries ($1
// consumer, $2 event ids) so the events apply again. A consumer's own table
// gets its statements from inbox.Table.
const (
	sqlInboxDiscarded = `INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence, outcome)
SELECT $1, d.id::uuid, d.t, d.a, d.s, 'discarded' FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[]) AS d(id, t, a, s)
ON CONFLICT (consumer, event_id) DO NOTHING`
	sqlForgetInbox = `DELETE FROM inbox WHERE consumer = $1 AND event_id = ANY($2::uuid[])`
)

// sqlSelectWhere narrows a selection of events: $1 event ids (empty: any),
// $2 aggregate type (empty for any), $3 created at or after, $4 created before
// (NULL: unbounded).
const sqlSelectWhere = `
  AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1::uuid[]))
  AND ($2 = '' OR aggregate_type = $2)
  AND ($3::timestamptz IS NULL OR created_at >= $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)`

const (
	// Dead events and their aggregates in a selection (sqlSelectWhere).
	sqlCountDead = `SELECT count(*), count(DISTINCT (aggregate_type, aggregate_id)) FROM outbox WHERE state = 'dead'` + sqlSelectWhere
	// dead-list: $1 aggregate type (empty for any), $2 most rows.
	sqlListDead = `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, aggregate_seq, attempts,
       coalesce(last_error, ''), created_at
FROM outbox WHERE state = 'dead' AND ($1 = '' OR aggregate_type = $1)
ORDER BY id LIMIT $2`
	// replay: the sent events of a selection (sqlSelectWhere), in each
	// aggregate's order; then their bodies by row id ($1).
	sqlReplayEvents = `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, aggregate_seq,
       coalesce(tenant_id, ''), coalesce(traceparent, '')
FROM outbox_events WHERE state = 'sent'` + sqlSelectWhere + `
ORDER BY aggregate_id, aggregate_seq`
	sqlBodies = `SELECT id, body FROM outbox WHERE id = ANY($1)`
	// prune's dry run: what outbox.Prune and inbox.Prune would delete, sent
	// and discarded events (outbox_events derives sent from the heads; a
	// sent event's age is its creation unless its row says when it was
	// sent) and inbox rows, older than $1.
	sqlCountPrunableEvents = `SELECT count(*) FROM outbox_events WHERE state IN ('sent', 'discarded') AND coalesce(sent_at, created_at) < $1`
	sqlCountPrunableInbox  = `SELECT count(*) FROM inbox WHERE processed_at < $1`
)
