package nats

import (
	"strings"
	"unicode"
)

// SanitizeToken makes s usable inside one subject token: NATS splits
// subjects on '.', treats '*' and '>' as wildcards and forbids whitespace, so
// each of those (and control characters) becomes '_'; an empty value becomes
// "_" so that the subject keeps its number of tokens. Event types such as
// "order.paid" therefore publish as "order_paid": write filters that way.
func SanitizeToken(s string) string {
	if s == "" {
		return "_"
	}
	clean := true
	for _, r := range s {
		if tokenBreaker(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	return strings.Map(func(r rune) rune {
		if tokenBreaker(r) {
			return '_'
		}
		return r
	}, s)
}

func tokenBreaker(r rune) bool {
	return r == '.' || r == '*' || r == '>' || unicode.IsSpace(r) || unicode.IsControl(r) || r == unicode.ReplacementChar
}

// headerValue keeps a header value on one line (NATS headers are MIME-style).
func headerValue(s string) string {
	if !strings.ContainsAny(s, "\r\n") {
		return s
	}
	return strings.NewReplacer("\r", " ", "\n", " ").Replace(s)
}
