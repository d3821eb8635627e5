package envelope

import (
	"encoding/json"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// The limits Validate enforces, one constant each. The rules they belong
// to are listed in the package doc; testdata/validation.json enumerates
// valid and invalid cases with the field each names, so other
// implementations of the rules (a database function, another language's
// producer) can be checked against the same table.
const (
	// MaxTypeLen bounds type: letters, digits and . _ - : / only.
	MaxTypeLen = 256
	// MaxAggregateTypeLen bounds aggregate_type (same characters as type).
	MaxAggregateTypeLen = 128
	// MaxGroupIDLen bounds aggregate_id, correlation_id and causation_id:
	// ASCII letters, digits and punctuation ('!' to '~'), as SNS FIFO
	// requires of a MessageGroupId.
	MaxGroupIDLen = 128
	// MaxTenantIDLen bounds tenant_id, in characters (printable UTF-8).
	MaxTenantIDLen = 128
	// MinOccurredYear and MaxOccurredYear bound occurred_at's year (UTC):
	// RFC 3339 writes four-digit years, and PostgreSQL has no year 0.
	MinOccurredYear = 1
	MaxOccurredYear = 9999
	// MaxSchemaVersion bounds schema_version (a PostgreSQL integer).
	MaxSchemaVersion = math.MaxInt32
	// MaxPayloadDepth bounds how deeply the payload nests arrays and
	// objects: a scalar has depth 0, {} and [] depth 1, {"a":[1]} depth 2.
	// With the envelope's own object the message nests at most 33 deep,
	// which every mainstream JSON decoder reads with its default limit
	// (.NET's 64 is the lowest).
	MaxPayloadDepth = 32
)

// checkPayload applies the payload rules: present, valid JSON, not null,
// valid UTF-8, no \u0000 and no unpaired surrogate escapes in strings, every
// number within a 64-bit float's range, at most MaxPayloadDepth deep, no
// object with two members of the same name.
// Reasons give byte offsets, never payload data.
func checkPayload(p []byte) error {
	if len(trimSpace(p)) == 0 {
		return missing("payload")
	}
	if !json.Valid(p) {
		return invalid("payload", "is not valid JSON")
	}
	if string(trimSpace(p)) == "null" {
		return &ValidationError{Field: "payload", Kind: ErrMissing, Reason: "is JSON null; use {} for an event without data"}
	}
	if !utf8.Valid(p) {
		return invalid("payload", "is not valid UTF-8")
	}
	type frame struct {
		obj       bool
		expectKey bool
		names     map[string]struct{}
	}
	var stack []frame
	for i := 0; i < len(p); i++ {
		switch p[i] {
		case '{', '[':
			if len(stack) == MaxPayloadDepth {
				return invalid("payload", "nests deeper than %d arrays and objects (at byte offset %d)", MaxPayloadDepth, i)
			}
			stack = append(stack, frame{obj: p[i] == '{', expectKey: p[i] == '{'})
		case '}', ']':
			stack = stack[:len(stack)-1]
		case ',':
			if top := len(stack) - 1; top >= 0 && stack[top].obj {
				stack[top].expectKey = true
			}
		case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			end := i
			for end < len(p) && strings.IndexByte("+-0123456789.eE", p[end]) >= 0 {
				end++
			}
			if _, err := strconv.ParseFloat(string(p[i:end]), 64); err != nil {
				return invalid("payload", "a number (at byte offset %d) does not fit a 64-bit floating point value", i)
			}
			i = end - 1
		case '"':
			end, err := scanString(p, i)
			if err != nil {
				return err
			}
			if top := len(stack) - 1; top >= 0 && stack[top].obj && stack[top].expectKey {
				var name string
				_ = json.Unmarshal(p[i:end+1], &name) // a valid string: json.Valid passed
				if stack[top].names == nil {
					stack[top].names = map[string]struct{}{}
				}
				if _, dup := stack[top].names[name]; dup {
					return invalid("payload", "an object has two members of the same name (at byte offset %d)", i)
				}
				stack[top].names[name] = struct{}{}
				stack[top].expectKey = false
			}
			i = end
		}
	}
	return nil
}

// scanString returns the index of the quote closing the string that opens
// at p[start], checking its \u escapes.
func scanString(p []byte, start int) (int, error) {
	for i := start + 1; i < len(p); i++ {
		switch p[i] {
		case '"':
			return i, nil
		case '\\':
			if p[i+1] != 'u' {
				i++
				continue
			}
			r := hex4(p[i+2 : i+6])
			switch {
			case r == 0:
				return 0, invalid("payload", "a string contains \\u0000 (at byte offset %d), which PostgreSQL jsonb and many consumers cannot store", i)
			case r >= 0xDC00 && r <= 0xDFFF:
				return 0, invalid("payload", "a string has an unpaired surrogate escape (at byte offset %d)", i)
			case r >= 0xD800 && r <= 0xDBFF:
				if i+12 > len(p) || p[i+6] != '\\' || p[i+7] != 'u' {
					return 0, invalid("payload", "a string has an unpaired surrogate escape (at byte offset %d)", i)
				}
				if lo := hex4(p[i+8 : i+12]); lo < 0xDC00 || lo > 0xDFFF {
					return 0, invalid("payload", "a string has an unpaired surrogate escape (at byte offset %d)", i)
				}
				i += 11
			default:
				i += 5
			}
		}
	}
	return 0, invalid("payload", "is not valid JSON")
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			r |= rune(c-'A') + 10
		}
	}
	return r
}

func trimSpace(b []byte) []byte {
	isSpace := func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
	for len(b) > 0 && isSpace(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isSpace(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}

// checkOccurredAt applies the occurred_at rule.
// Go's zero time, 0001-01-01T00:00:00Z, counts as missing.
func checkOccurredAt(e Envelope) error {
	if e.OccurredAt.IsZero() {
		return missing("occurred_at")
	}
	if y := e.OccurredAt.UTC().Year(); y < MinOccurredYear || y > MaxOccurredYear {
		return invalid("occurred_at", "year %d is outside %04d-%04d (UTC)", y, MinOccurredYear, MaxOccurredYear)
	}
	return nil
}
