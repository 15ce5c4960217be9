"""Month and weekday names of languages other than English, for a page's date words.

A page's BM25 row holds its date in words (``lexical.date_words``: ``monday 8 may 2023``), so
a question that names a month or a day finds the pages of that date. In English only, a
question in French (``en mai``) matched only the numbers. So a page written in one of these
languages (found from its words by the stopword lists: ``csrc/include/memoryos/languages.h``)
also gets its weekday and month in that language's words; an English page's row is as before.
Names are as a question writes them in the nominative; a language that inflects month names
(Polish ``w maju``, Russian ``в мае``) matches the nominative only.
"""

from __future__ import annotations

from memoryos_gpu.text.stopword_lists import LANGUAGES
from memoryos_gpu.text.words import normalise

#: By language (as :data:`~memoryos_gpu.text.stopword_lists.LANGUAGES` names it): the months
#: from January, then the weekdays from Monday, separated by spaces.
DATE_NAMES: dict[str, str] = {
    "es": (
        "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre "
        "lunes martes miércoles jueves viernes sábado domingo"
    ),
    "fr": (
        "janvier février mars avril mai juin juillet août septembre octobre novembre décembre "
        "lundi mardi mercredi jeudi vendredi samedi dimanche"
    ),
    "de": (
        "januar februar märz april mai juni juli august september oktober november dezember "
        "montag dienstag mittwoch donnerstag freitag samstag sonntag"
    ),
    "pt": (
        "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro "
        "segunda terça quarta quinta sexta sábado domingo"
    ),
    "it": (
        "gennaio febbraio marzo aprile maggio giugno "
        "luglio agosto settembre ottobre novembre dicembre "
        "lunedì martedì mercoledì giovedì venerdì sabato domenica"
    ),
    "nl": (
        "januari februari maart april mei juni juli augustus september oktober november december "
        "maandag dinsdag woensdag donderdag vrijdag zaterdag zondag"
    ),
    "sv": (
        "januari februari mars april maj juni juli augusti september oktober november december "
        "måndag tisdag onsdag torsdag fredag lördag söndag"
    ),
    "da": (
        "januar februar marts april maj juni juli august september oktober november december "
        "mandag tirsdag onsdag torsdag fredag lørdag søndag"
    ),
    "nb": (
        "januar februar mars april mai juni juli august september oktober november desember "
        "mandag tirsdag onsdag torsdag fredag lørdag søndag"
    ),
    "fi": (
        "tammikuu helmikuu maaliskuu huhtikuu toukokuu kesäkuu "
        "heinäkuu elokuu syyskuu lokakuu marraskuu joulukuu "
        "maanantai tiistai keskiviikko torstai perjantai lauantai sunnuntai"
    ),
    "ca": (
        "gener febrer març abril maig juny juliol agost setembre octubre novembre desembre "
        "dilluns dimarts dimecres dijous divendres dissabte diumenge"
    ),
    "ro": (
        "ianuarie februarie martie aprilie mai iunie "
        "iulie august septembrie octombrie noiembrie decembrie "
        "luni marți miercuri joi vineri sâmbătă duminică"
    ),
    "pl": (
        "styczeń luty marzec kwiecień maj czerwiec "
        "lipiec sierpień wrzesień październik listopad grudzień "
        "poniedziałek wtorek środa czwartek piątek sobota niedziela"
    ),
}


def language_dates() -> list[list[str]]:
    """The native term splitter's table: by language list (``LANGUAGES`` order), its date
    names as the splitter reads words (normalised), or an empty list."""
    return [[normalise(w) for w in DATE_NAMES.get(lang, "").split()] for lang in LANGUAGES]
